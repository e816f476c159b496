"""No pickle on a path a client or a foreign process can reach (issue 13): the source has no
pickle imports or loads; a crafted weight-broadcast header (a pickle payload, bad JSON,
unknown dtypes, bad shapes) is refused without running code, also through a real gloo
group; the trainer command channel's wire format refuses crafted messages (a pickle
payload, foreign classes) and a worker fed one reports the error instead of running it."""

from __future__ import annotations

import json
import os
import pickle  # noqa: S403 - only to build the hostile payloads the code under test must refuse
import re
import threading
from pathlib import Path

import pytest
import torch

from rl_core.train import wire
from rl_core.weights.broadcast import (BroadcastGroup, BroadcastHeaderError, WeightBroadcaster, WeightReceiver,
                                       encode_header, parse_header)
from tests.helpers.trainers import free_port

ROOT = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this creates `path` (a harmless stand-in for arbitrary code)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_no_pickle_in_rl_core_sources():
    banned = re.compile(r"^\s*(import (c?pickle|dill|cloudpickle|shelve|marshal)\b|from (c?pickle|dill|cloudpickle|"
                        r"shelve|marshal) import)|\b(c?pickle|dill|cloudpickle)\.loads?\(", re.M)
    torch_load = re.compile(r"torch\.load\(([^()]|\([^()]*\))*\)", re.S)
    found = []
    for path in sorted((ROOT / "rl_core").rglob("*.py")):
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in banned.finditer(text)]
        found += [f"{path.relative_to(ROOT)}: {m.group(0)[:60]}" for m in torch_load.finditer(text)
                  if "weights_only=True" not in m.group(0)]
    assert not found, "pickle on rl_core paths:\n" + "\n".join(found)
    # the modules a client or another local process can reach use no pickling collectives either
    reachable = [*(ROOT / "rl_core/serve").glob("*.py"), *(ROOT / "rl_core/weights").glob("*.py"),
                 *(ROOT / "rl_core/generation/http").glob("*.py"), ROOT / "rl_core/train/spmd.py",
                 ROOT / "rl_core/train/wire.py", ROOT / "rl_core/launch/serve.py", ROOT / "rl_core/train/dcp_io.py"]
    # the HTTP backend moved from generation/http_*.py into generation/http/: a glob that matches
    # nothing would pass silently, so every group must be there
    assert all(p.is_file() for p in reachable), reachable
    assert {p.parent.name for p in reachable} >= {"serve", "weights", "http", "train", "launch"}, reachable
    for path in reachable:
        assert not re.search(r"_object(_list)?\(", path.read_text()), path


def _good_entries():
    return [["a", "float32", [2, 3], None], ["b", "bfloat16", [], None], ["c", "float32", [2, 3], "a"]]


def _header(**change):
    data = {"format": "rl_core.weights.broadcast/1", "version": 3, "tensors": _good_entries(), **change}
    return json.dumps(data).encode()


def test_a_good_header_parses():
    version, entries = parse_header(encode_header(3, [("a", "float32", (2, 3), None), ("c", "float32", (2, 3), "a")]))
    assert version == 3 and entries == [("a", torch.float32, (2, 3), None), ("c", torch.float32, (2, 3), "a")]
    assert parse_header(_header())[0] == 3


CRAFTED = {
    "pickle-payload": None,  # filled in the test (needs tmp_path)
    "not-utf8": b"\xff\xfe\x00",
    "not-json": b"{version: 3}",
    "json-list": b"[3, []]",
    "infinity-constant": _header().replace(b'"version": 3', b'"version": Infinity'),
    "extra-key": _header(code="os.system('x')"),
    "wrong-format": _header(format="pickle"),
    "version-negative": _header(version=-1),
    "version-float": _header(version=3.0),
    "version-bool": _header(version=True),
    "dtype-unknown": _header(tensors=[["a", "object", [1], None]]),
    "dtype-torch-prefixed": _header(tensors=[["a", "torch.float32", [1], None]]),
    "dtype-not-a-string": _header(tensors=[["a", {"__class__": "x"}, [1], None]]),
    "shape-negative": _header(tensors=[["a", "float32", [-1], None]]),
    "shape-float": _header(tensors=[["a", "float32", [1.5], None]]),
    "shape-too-many-dims": _header(tensors=[["a", "float32", [1] * 9, None]]),
    "shape-huge": _header(tensors=[["a", "float32", [2**30, 2**30], None]]),
    "name-not-a-string": _header(tensors=[[5, "float32", [1], None]]),
    "name-duplicate": _header(tensors=[["a", "float32", [1], None], ["a", "float32", [1], None]]),
    "alias-unknown": _header(tensors=[["a", "float32", [1], "zzz"]]),
    "alias-other-shape": _header(tensors=[["a", "float32", [1], None], ["b", "float32", [2], "a"]]),
    "entry-short": _header(tensors=[["a", "float32"]]),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_header_is_refused_without_running_code(case, tmp_path):
    marker = tmp_path / "ran"
    raw = CRAFTED[case] if case != "pickle-payload" else pickle.dumps((3, [_Payload(marker)]))
    with pytest.raises(BroadcastHeaderError, match="weight-broadcast header refused"):
        parse_header(raw)
    assert not marker.exists()


def test_a_hostile_sender_in_the_group_cannot_run_code_in_a_receiver(tmp_path):
    """A real 2-rank gloo group (threads): rank 0 broadcasts a pickle payload as the header,
    as the old format would have carried it; the receiver refuses it and nothing ran."""
    marker = tmp_path / "ran"
    port = free_port()

    def hostile():
        group = BroadcastGroup.create("127.0.0.1", port, 0, 2, timeout_s=60)
        blob = torch.frombuffer(bytearray(pickle.dumps((1, [_Payload(marker)]))), dtype=torch.uint8)
        group.broadcast(torch.tensor([blob.numel()], dtype=torch.int64))
        group.broadcast(blob)

    assert "not UTF-8 JSON" in _receive_from(hostile, port) and not marker.exists()


def test_a_hostile_length_is_refused_before_allocating(tmp_path):
    port = free_port()

    def hostile():
        group = BroadcastGroup.create("127.0.0.1", port, 0, 2, timeout_s=60)
        group.broadcast(torch.tensor([2**62], dtype=torch.int64))

    assert "announced length" in _receive_from(hostile, port)


def test_the_sender_refuses_a_dtype_outside_the_header_list():
    class _Group:
        rank, device = 0, torch.device("cpu")

        def broadcast(self, t):
            raise AssertionError("nothing may be sent")

    with pytest.raises(ValueError, match="cannot be broadcast"):
        WeightBroadcaster(_Group()).send(1, {"x": torch.zeros(2, dtype=torch.complex64)})


# ---------------------------------------------------------------------- trainer command channel


def test_wire_round_trips_the_commands_values():
    from rl_core.algorithms.losses import make_loss
    from rl_core.config.schema import LossConfig
    from rl_core.config.trainer_sections import TrainerConfig
    from rl_core.types import TrainChunk

    x = torch.arange(12).reshape(3, 4)
    chunk = TrainChunk(x, x[:, :], x.float(), x.float()[:, :2].repeat(1, 2), torch.zeros(3, 4), torch.ones(3),
                       torch.zeros(3, dtype=torch.long))  # views of one storage travel as separate tensors
    loss = make_loss(LossConfig(kl_coef=0.1), multi_update=True)
    msg = ["__init__", (1, 2.5, float("inf"), None, "s"),
           {"cfg": TrainerConfig(), "path": Path("/a/b"), "loss": loss, "chunk": chunk, "nested": [{"k": (1,)}]}]
    name, args, kwargs = wire.loads(wire.dumps(msg))
    assert name == "__init__" and args == (1, 2.5, float("inf"), None, "s")
    assert kwargs["cfg"] == TrainerConfig() and kwargs["path"] == Path("/a/b") and kwargs["nested"] == [{"k": (1,)}]
    assert type(kwargs["loss"]) is type(loss) and kwargs["loss"].cfg == loss.cfg and kwargs["loss"].needs_prev_logprobs
    for f in ("input_ids", "attention_mask", "loss_mask", "gen_logprobs", "advantages", "sample_mask"):
        a, b = getattr(kwargs["chunk"], f), getattr(chunk, f)
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert kwargs["chunk"].ref_logprobs is None


def test_wire_refuses_to_send_other_types():
    with pytest.raises(wire.WireError, match="cannot travel"):
        wire.dumps([_Payload("/tmp/x")])
    with pytest.raises(wire.WireError, match="keys must be strings"):
        wire.dumps({1: 2})


def _raw(tree, blob=b""):
    head = json.dumps(tree).encode()
    return wire.MAGIC + len(head).to_bytes(8, "little") + head + blob


@pytest.mark.parametrize("case", ["pickle", "section-outside-config", "section-not-a-section", "section-dotted-name",
                                  "unknown-obj", "unknown-tag", "missing-tensor", "bad-blob", "truncated",
                                  "bad-loss-data"])
def test_wire_refuses_crafted_messages_without_running_code(case, tmp_path):
    marker = tmp_path / "ran"
    data = {
        "pickle": pickle.dumps(("begin", (_Payload(marker),), {})),
        "section-outside-config": _raw({"$section": "os:system", "data": {}}),
        "section-not-a-section": _raw({"$section": "rl_core.config.base:fail", "data": {}}),
        "section-dotted-name": _raw({"$section": "rl_core.config..x:Y", "data": {}}),
        "unknown-obj": _raw({"$obj": "subprocess", "data": ["touch", str(marker)]}),
        "unknown-tag": _raw({"__reduce__": ["os.mkdir", [str(marker)]]}),
        "missing-tensor": _raw({"$tensor": "t0"}),
        "bad-blob": _raw([1], b"garbage"),
        "truncated": _raw({"$dict": {}})[:-3],
        "bad-loss-data": _raw({"$obj": "policy_gradient_loss", "data": {"$dict": {"cfg": 1, "multi_update": True}}}),
    }[case]
    with pytest.raises(wire.WireError):
        wire.loads(data)
    assert not marker.exists()


def test_a_worker_fed_a_crafted_command_reports_it_and_runs_nothing(tmp_path):
    import torch.distributed as dist

    from rl_core.train.spmd import CommandChannel

    marker = tmp_path / "ran"
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    worker = CommandChannel(1, 2, store=store, timeout_s=30)
    dist.PrefixStore("rl_core/trainer/", store).set("cmd/0", pickle.dumps(("__init__", (), {"x": _Payload(marker)})))
    built = []
    with pytest.raises(wire.WireError, match="bad magic"):
        worker.serve(lambda **kw: built.append(kw))
    status = dist.PrefixStore("rl_core/trainer/", store).get("done/0/1").decode()
    assert "WireError" in status and not built and not marker.exists()


def _receive_from(sender, port: int) -> str:
    """Run `sender` as rank 0 of a real gloo group and a WeightReceiver as rank 1; the receiver's
    BroadcastHeaderError message ("" when it accepted the message)."""
    out: dict = {}

    def receiver():
        group = BroadcastGroup.create("127.0.0.1", port, 1, 2, timeout_s=60)
        try:
            WeightReceiver(group).recv()
        except BroadcastHeaderError as exc:
            out["error"] = str(exc)

    threads = [threading.Thread(target=sender), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out.get("error", "")


# ---------------------------------------------------------------------- sharded (DCP) checkpoints


def _dcp_checkpoint(d: Path):
    """A real DCP checkpoint of a small model + AdamW state, written as FSDPTrainer writes it
    (single process); returns the state dict it holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rl_core.train.dcp_io import JsonMetadataWriter

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optimizer": osd}, storage_writer=JsonMetadataWriter(str(d)))
    return msd


def _dcp_load(d: Path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rl_core.train.dcp_io import load_sharded

    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=5.0)
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optimizer": osd}
    load_sharded(state, d)  # what FSDPTrainer.load_checkpoint runs on every rank
    return state


@pytest.mark.filterwarnings("ignore")
def test_a_sharded_checkpoint_loads_without_opening_its_pickled_metadata(tmp_path):
    """DCP's own `.metadata` is a pickle: replaced by a payload, the load still restores the state
    from rl_core's JSON metadata, and the payload never ran."""
    ck, marker = tmp_path / "dcp", tmp_path / "ran"
    saved = _dcp_checkpoint(ck)
    assert (ck / "metadata.json").is_file()
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    state = _dcp_load(ck)
    assert torch.equal(state["model"]["weight"], saved["weight"]) and torch.equal(state["model"]["bias"], saved["bias"])
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-3  # a non-tensor entry, read weights-only
    assert not marker.exists()


def _edit_dcp_json(ck: Path, fn) -> None:
    p = ck / "metadata.json"
    p.write_text(json.dumps(fn(json.loads(p.read_text()))))


def _first_bytes_entry(data: dict) -> dict:
    name = next(k for k, v in data["state_dict_metadata"].items() if v["kind"] == "bytes")
    return next(s for s in data["storage_data"] if s["fqn"] == name)


def _evil_bytes_entry(ck: Path, marker: Path) -> None:
    import io

    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)  # what a crafted checkpoint would store for a non-tensor entry
    (ck / "evil.distcp").write_bytes(buf.getvalue())

    def point(data):
        entry = _first_bytes_entry(data)
        entry.update(relative_path="evil.distcp", file_offset=0, length=len(buf.getvalue()))
        return data

    _edit_dcp_json(ck, point)


DCP_CRAFTED = {
    "metadata-missing": (lambda ck, m: (ck / "metadata.json").unlink(), "cannot be read"),
    "metadata-not-json": (lambda ck, m: (ck / "metadata.json").write_bytes(b"\x80\x04K\x01."), "malformed"),
    "wrong-format": (lambda ck, m: _edit_dcp_json(ck, lambda d: {**d, "format": "pickle"}), "malformed"),
    "dtype-not-torch": (lambda ck, m: _edit_dcp_json(ck, lambda d: {**d, "state_dict_metadata": {
        k: ({**v, "dtype": "system"} if v["kind"] == "tensor" else v) for k, v in d["state_dict_metadata"].items()}}),
        "not a torch dtype"),
    "file-outside": (lambda ck, m: _edit_dcp_json(ck, lambda d: (_first_bytes_entry(d).update(
        relative_path="../x.distcp"), d)[1]), "outside the checkpoint"),
    "nul-in-path": (lambda ck, m: _edit_dcp_json(ck, lambda d: (_first_bytes_entry(d).update(
        relative_path="__0_0.distcp\x00"), d)[1]), "NUL byte"),
    "negative-length": (lambda ck, m: _edit_dcp_json(ck, lambda d: (_first_bytes_entry(d).update(length=-1), d)[1]),
                        "file_offset / length"),
    "pickle-payload-entry": (_evil_bytes_entry, "was refused"),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", list(DCP_CRAFTED))
def test_a_crafted_sharded_checkpoint_is_refused_without_running_code(case, tmp_path):
    from rl_core.errors import CheckpointError

    ck, marker = tmp_path / "dcp", tmp_path / "ran"
    _dcp_checkpoint(ck)
    damage, words = DCP_CRAFTED[case]
    damage(ck, marker)
    with pytest.raises(CheckpointError) as info:  # not DCP's wrapped CheckpointException
        _dcp_load(ck)
    msg = str(info.value)
    assert words in msg and "FSDPTrainer.save_checkpoint" in msg and "\n" not in msg, msg
    assert not marker.exists()


def test_rl_core_loads_sharded_checkpoints_only_through_the_json_reader():
    calls = []
    for path in sorted((ROOT / "rl_core").rglob("*.py")):
        calls += [(path.name, line.strip()) for line in path.read_text().splitlines() if "dcp.load(" in line]
    assert calls == [("dcp_io.py", 'dcp.load(state, storage_reader=JsonMetadataReader(str(path)), '
                                   'planner=SafeLoadPlanner())')], calls
