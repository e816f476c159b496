"""Which generation backend can run where, and what each backend can honour: checked at
config load (the recipe alone, no torch, nothing built).

Owns: the support table of (generation backend, placement) pairs (`colocated`: the trainer's
process and device, the native engine in a worker thread or vLLM's AsyncLLM; `separate`:
own processes or nodes reached over HTTP), the cross-field rules of `generation.vllm` and
of the weight broadcast to local servers, raised as `RecipeError`s naming the field, the
value, what is expected and the fix; the generation node group (`cluster.generation`: which
servers it places, and that the controller job's allocation holds it). `schema.py` calls
`check_generation` from `GenerationConfig` and `check_recipe` from `RecipeConfig`.

Does not own: building anything (rl_core.launch.placement does that).

Read more: docs/generation.md, "Picking a backend" and "Placement rules".
"""

from __future__ import annotations

from typing import Any

from rl_core.config.base import fail

# (backend, placement) -> how it runs; a pair missing here fails at config load.
SUPPORTED: dict[tuple[str, str], str] = {
    ("native", "colocated"): "rl_core's engine in a worker thread of the controller process",
    ("vllm", "colocated"): "vLLM's AsyncLLM driven from the controller's event loop",
    ("vllm", "separate"): "a vLLM OpenAI-compatible server process, driven over HTTP",
    ("http", "separate"): "rl-core serve processes (started by rl_core, or at generation.http.urls), driven over HTTP",
}

VLLM_MIN_TEMPERATURE = 0.01  # vLLM raises 0 < T < 0.01 to 0.01


def _supported_list() -> str:
    return ", ".join(f"{b}/{p}" for b, p in SUPPORTED)


def check_generation(gen: Any) -> None:
    """Rules that need only the `generation` section."""
    pair = (gen.backend, gen.placement)
    if pair not in SUPPORTED:
        others = [p for b, p in SUPPORTED if b == gen.backend]
        fix = (f"set generation.placement: {others[0]} for backend '{gen.backend}'" if others else
               f"pick a backend that supports placement '{gen.placement}'")
        if gen.backend == "native" and gen.placement == "separate":
            fix += (" (or generation.backend: http, which runs rl_core's engine in `rl-core serve` processes, or "
                    "generation.backend: vllm, whose `separate` placement runs a vLLM server process)")
        fail("generation.placement", gen.placement,
              f"a placement that generation.backend '{gen.backend}' supports (supported backend/placement pairs: "
              f"{_supported_list()})", fix + ".")
    if gen.backend != "vllm":
        return
    v = gen.vllm
    if v.server_url is not None and gen.placement != "separate":
        fail("generation.vllm.server_url", v.server_url,
              f"null with generation.placement '{gen.placement}' (a server URL means generation runs in another "
              "process: placement 'separate')",
              "set generation.placement: separate to drive that server, or remove generation.vllm.server_url.")
    if v.server_url is not None and not v.server_url.startswith(("http://", "https://")):
        fail("generation.vllm.server_url", v.server_url, "an http(s) URL such as http://127.0.0.1:8000",
              "write the server's base URL with its scheme, host and port.")
    _check_vllm_sampling(gen, "generation")
    if v.max_model_len is not None and v.max_model_len <= gen.max_tokens:
        fail("generation.vllm.max_model_len", v.max_model_len,
              f"more than generation.max_tokens ({gen.max_tokens}) so that a prompt still fits",
              "raise generation.vllm.max_model_len or lower generation.max_tokens.")


def _check_vllm_sampling(params: Any, section: str) -> None:
    """vLLM reports logprobs of the top-k/top-p *filtered* distribution (rl_core's are before
    filtering), and raises temperatures in (0, 0.01) to 0.01."""
    if params.is_greedy:
        return
    for name, off in (("top_p", 1.0), ("top_k", 0)):
        value = getattr(params, name)
        if value != off:
            fail(f"{section}.{name}", value,
                  f"{off} with generation.backend 'vllm' (vLLM's logprobs are those of the {name}-filtered "
                  "distribution; rl_core's, which the trainer reproduces, are before filtering)",
                  f"set {section}.{name}: {off}, or use generation.backend: native.")
    if params.temperature < VLLM_MIN_TEMPERATURE:
        fail(f"{section}.temperature", params.temperature,
              f"0 (greedy) or >= {VLLM_MIN_TEMPERATURE} with generation.backend 'vllm' (vLLM raises smaller "
              "temperatures to 0.01, so its logprobs would not be at the requested temperature)",
              f"use temperature 0 or >= {VLLM_MIN_TEMPERATURE}.")


def _check_weight_broadcast(cfg: Any) -> None:
    """`trainer.weight_sync.type: broadcast` reaches only processes that join its group: the
    local `rl-core serve` servers of `generation.backend: http`; local servers on other GPUs
    need a CUDA run."""
    gen, ws = cfg.generation, cfg.trainer.weight_sync
    if ws.type == "broadcast" and (gen.backend != "http" or gen.http.num_local_servers < 1):
        fail("trainer.weight_sync.type", "broadcast",
              "generation.backend 'http' with generation.http.num_local_servers >= 1 (the weight broadcast joins "
              f"the local rl-core serve processes; this recipe has backend '{gen.backend}'"
              + (f", num_local_servers {gen.http.num_local_servers})" if gen.backend == "http" else ")"),
              "set generation.backend: http, generation.placement: separate and generation.http.num_local_servers: "
              "1 (or more), or use trainer.weight_sync.type: filesystem (remote servers) / in_process (native).")
    if gen.http.local_server_cuda_devices and cfg.runtime.device == "cpu":
        fail("generation.http.local_server_cuda_devices", gen.http.local_server_cuda_devices,
              "empty with runtime.device 'cpu' (local servers then run on the CPU)",
              "remove generation.http.local_server_cuda_devices, or set runtime.device: cuda (or auto).")


def _check_generation_group(cfg: Any) -> None:
    """`cluster.generation` places the `rl-core serve` servers that rl_core starts
    (`generation.backend: http`, `num_local_servers`) on nodes of their own, inside the
    controller job's one allocation (docs/cluster.md): one server per process of the group,
    and the allocation holds the trainer's nodes and the group's."""
    group, gen, cluster = cfg.cluster.generation, cfg.generation, cfg.cluster
    if group is None or gen.placement != "separate":
        return  # colocated: refused by rl_core.config.trainer_sections.check_trainer_placement
    if gen.backend != "http" or gen.http.urls:
        fail("cluster.generation", group.model_dump(),
              "generation.backend 'http' with servers rl_core starts (generation.http.num_local_servers): those are "
              "what the group places" + (f"; this recipe has backend '{gen.backend}', whose server runs on the "
                                         "controller's node" if gen.backend != "http" else
                                         "; servers at generation.http.urls are placed by whoever started them"),
              "set generation.backend: http with generation.http.num_local_servers (and no urls), or remove "
              "cluster.generation.")
    if gen.http.num_local_servers != group.world_size:
        fail("generation.http.num_local_servers", gen.http.num_local_servers,
              f"{group.world_size}: one rl-core serve per process of cluster.generation ({group.num_nodes} node(s) x "
              f"{group.world_size // group.num_nodes} per node)",
              f"set generation.http.num_local_servers: {group.world_size}, or change cluster.generation.")
    job = cluster.controller
    trainer_nodes = cluster.trainer.num_nodes if cluster.trainer is not None else 1
    if job.nodes < trainer_nodes + group.num_nodes:
        fail("cluster.controller.nodes", job.nodes,
              f"at least {trainer_nodes + group.num_nodes}: the controller job is one allocation holding the trainer's "
              f"{trainer_nodes} node(s) (cluster.trainer) and the generation group's {group.num_nodes} "
              "(cluster.generation)", f"set cluster.controller.nodes: {trainer_nodes + group.num_nodes}.")
    per_node = group.world_size // group.num_nodes
    if per_node > job.tasks_per_node or group.num_gpus_per_node > job.gpus_per_node:
        fail("cluster.generation", group.model_dump(),
              f"a group whose nodes fit the controller job's (cluster.controller: {job.tasks_per_node} task(s) and "
              f"{job.gpus_per_node} GPU(s) per node; one allocation asks the same of every node)",
              "raise cluster.controller.tasks_per_node / gpus_per_node, or shrink the group's processes or GPUs.")


def check_recipe(cfg: Any) -> None:
    """Rules across sections."""
    gen = cfg.generation
    _check_weight_broadcast(cfg)
    _check_generation_group(cfg)
    if gen.backend != "vllm":
        return
    _check_vllm_sampling(cfg.validation.sampling, "validation.sampling")
    if cfg.model.source == "tiny" and gen.vllm.max_model_len is not None:
        limit = cfg.model.tiny.max_position_embeddings
        if gen.vllm.max_model_len > limit:
            fail("generation.vllm.max_model_len", gen.vllm.max_model_len,
                  f"at most model.tiny.max_position_embeddings ({limit}): vLLM refuses a longer context than the "
                  "model's", f"set generation.vllm.max_model_len to {limit} or less, or null (the model's context).")
