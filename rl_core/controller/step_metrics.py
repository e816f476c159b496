"""Per-RL-step metrics: what the train-step log reports about the step and its rollouts.

Owns: turning one step's trained groups, the trainer's and the refit's metrics and the
pumps' counters into one flat dict: rewards and accuracy, advantages, lengths (mean and
percentiles of generated / input / total tokens; histograms go to TensorBoard), truncation
rate, environment and generation timings, staleness in versions and trajectory age in
seconds (from the group's commit to the buffer until the train pump selected it: the time
its samples waited, not the training and refit after), the generated tokens of the step's
trained samples per generation worker (`rollout/worker_gen_tokens/<worker>`), and the
aborted / evicted / dropped / wasted counts, read from the pumps' `PumpLedger`.

Does not own: where metrics go (metrics.logger) or how they are computed upstream.
"""

from __future__ import annotations

import math
import operator
import statistics
import time
from collections import Counter
from fractions import Fraction
from itertools import chain, compress, repeat

from rl_core.algorithms.metrics import finalize_metrics
from rl_core.columns import DictColumns, GroupSamples, group_columns
from rl_core.controller.ledger import PumpLedger


def _pct(s: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of the sorted list `s`."""
    if not s:
        return 0.0
    return float(s[min(len(s) - 1, int(round(q * (len(s) - 1))))])


def pstdev(values: list[float]) -> float:
    """`statistics.pstdev(values)` (the same float: the correctly rounded square root of the
    exact population variance), computed over the distinct values with their counts: group
    advantages take few distinct values (two per group for 0/1 rewards), so the exact
    fractions are summed once per value, not once per sample. Falls back to
    `statistics.pstdev` when most values are distinct, for non-floats and non-finite values."""
    n = len(values)
    counts = Counter(values)
    if n == 0 or 4 * len(counts) > n or not all(type(x) is float and math.isfinite(x) for x in counts):
        return statistics.pstdev(values)
    sx = sum(Fraction(x) * c for x, c in counts.items())
    sxx = sum(Fraction(x) ** 2 * c for x, c in counts.items())
    mss = (n * sxx - sx * sx) / n / n  # exact: the sum of squared deviations over n, over n
    out = sqrt_of_fraction(mss.numerator, mss.denominator)
    return out if out is not None else statistics.pstdev(values)


def sqrt_of_fraction(num: int, den: int) -> float | None:
    """The correctly rounded square root of num / den (num >= 0, den > 0) as a float, by integer
    arithmetic only; None where the result would be subnormal (callers fall back). An integer
    square root carrying at least 55 significant bits, rounded to odd (its last bit set when the
    root is inexact), then rounded once to the 53 bits of a float: rounding to odd with two or
    more extra bits makes the second rounding correct (Boldo & Melquiond 2008, "Emulation of
    FMA and correctly rounded sums: proved algorithms using rounding to odd")."""
    if num == 0:
        return 0.0
    k = 55 - (num.bit_length() - den.bit_length()) // 2  # 2^k * sqrt(num / den) >= 2^54
    q, r = divmod(num << 2 * k, den) if k >= 0 else divmod(num, den << -2 * k)
    root = math.isqrt(q)
    if r or root * root != q:
        root |= 1  # round to odd: the exact root lies strictly between root and root + 1
    if root.bit_length() - k <= -1021:  # below 2^-1022: a subnormal result would round twice
        return None
    return math.ldexp(float(root), -k)


_ADVANTAGES = operator.attrgetter("advantages")
_GROUP_SAMPLES = operator.attrgetter("group.samples")
_INFO_COLUMNS = operator.attrgetter("info_columns")
_REWARDS = operator.attrgetter("rewards")
_HAS_SEGMENTS = operator.methodcaller("has", "segments")
_WORKER_TOTALS = operator.methodcaller("worker_totals")
_GENERATE_S = operator.attrgetter("generate_s")
_EPOCH = operator.attrgetter("group.epoch")


_KEYS = operator.attrgetter("keys")


def _component_names(comp_groups: list) -> set[str]:
    """`set().union(*(c.names() for c in comp_groups))`, the same set in the same iteration
    order (the metrics' key order follows it), without a set per group where every group's
    dicts share one tuple of keys (the usual case): unioning one set again adds nothing, and
    only the second union may grow the table (the fill and the table size do not change after
    it), so two unions of it stand for any number."""
    keys = set(map(_KEYS, comp_groups))
    if len(keys) == 1 and None not in keys:
        return set().union(*[set(next(iter(keys)))] * min(len(comp_groups), 2))
    return set().union(*(c.names() for c in comp_groups))


def step_metrics(ledger: PumpLedger, step: int, trained, train_metrics: dict, refit_metrics: dict, t_step0: float,
                 idle: float, *, step_pairs: dict | None = None, policy_frozen: bool = False, buffer_live: int = 0,
                 gc_clock=None) -> dict:
    """One RL step's metrics from its trained groups and the run's counters in `ledger`;
    `step_pairs` are the step's (sum, count) metrics (advantage, shaping, dynamic sampling),
    `buffer_live` the buffer's live groups, `gc_clock` a `metrics.gc_pauses.GcClock` (or None)."""
    advs = list(chain.from_iterable(map(_ADVANTAGES, trained)))
    stal = [t.staleness for t in trained]
    now = time.monotonic()
    # waited in the buffer: commit -> selection (a group restored from a checkpoint has no commit time)
    ages = [t.slot.selected_at - t.slot.ready_at for t in trained
            if t.slot.ready_at is not None and t.slot.selected_at is not None]
    # per sample (16,000 per step at 1,000 groups x 16), read through each group's columns
    # (columns.group_columns: a single-turn group held as a GroupSamples without building Samples)
    all_cols = list(map(group_columns, map(_GROUP_SAMPLES, trained)))

    def joined(name: str) -> list:
        """Column `name` of every group, end to end (one C-level pass over the groups)."""
        return list(chain.from_iterable(map(operator.attrgetter(name), all_cols)))

    rewards, gen_len, in_len = joined("rewards"), joined("generated_lens"), joined("prompt_lens")
    env_s = joined("env_s")
    n = len(rewards)
    if n and list(map(type, all_cols)).count(GroupSamples) == len(all_cols):
        # single-turn groups held as columns: one generation time per group (`generate_s_each`
        # repeats it per sample) and one turn per sample; the means over the same values without
        # a list of them (`fmean` is `fsum(values) / len(values)`)
        gen_each = list(map(_GENERATE_S, all_cols))
        gen_s_mean = math.fsum(chain.from_iterable(map(repeat, gen_each, map(len, all_cols)))) / n
        gen_s_max = max(compress(gen_each, map(len, all_cols)))
        turns_mean = 1.0  # fmean of n ones
    else:
        gen_s, turns = joined("generate_s_each"), joined("turns")
        gen_s_mean, gen_s_max, turns_mean = statistics.fmean(gen_s), max(gen_s), statistics.fmean(turns)
    tot_len = list(map(operator.add, in_len, joined("completion_lens")))  # prompt + completion per sample
    truncated = sum(map(operator.methodcaller("count", "length"), map(operator.attrgetter("finish_reasons"), all_cols)))
    # the per-group reads as passes over all groups (C-level maps; no Python loop body per group
    # for the accuracy): the same counts as a loop over the groups
    zero_variance = 0
    for rs in map(_REWARDS, all_cols):  # len(set(rs)) == 1 (the group's rewards all equal), without a set
        zero_variance += len(rs) > 0 and rs.count(rs[0]) == len(rs)
    infos = list(map(_INFO_COLUMNS, all_cols))
    oks = DictColumns.joined(infos, "correct")  # is_correct, inlined: info["correct"] where reported, else None
    if None in oks:
        correct = sum(bool(ok) if ok is not None else r > 0 for ok, r in zip(oks, rewards))
    else:
        correct = sum(map(bool, oks))
    breaks = 0
    for info in compress(infos, map(_HAS_SEGMENTS, infos)):
        breaks += sum(v - 1 for v in info.column("segments", 1))
    workers: dict[str, int] = {}
    for totals in map(_WORKER_TOTALS, all_cols):
        for w, c in totals.items():
            workers[w] = workers.get(w, 0) + c
    comp_groups = [c.component_columns for c in all_cols]  # the named reward components of each group, in order
    gen_sorted = sorted(gen_len)
    gen_mean = statistics.fmean(gen_len)  # two keys report it
    step_s = now - t_step0
    rs, ts = ledger.rollout_stats, ledger.train_stats
    m = {
        "train/reward_mean": statistics.fmean(rewards),
        "train/accuracy": correct / n,  # == fmean of 0/1 values
        "train/advantage_mean": statistics.fmean(advs),
        "train/advantage_abs_mean": math.fsum(map(abs, advs)) / len(advs),  # == statistics.fmean (fsum / n)
        "train/advantage_std": pstdev(advs),
        "train/zero_variance_groups": zero_variance / len(trained),
        "train/num_groups": float(len(trained)),
        "train/completion_len_mean": gen_mean,
        "train/truncation_rate": truncated / n,
        "rollout/gen_tokens_per_sample_mean": gen_mean,
        "rollout/gen_tokens_p50": _pct(gen_sorted, 0.5),
        "rollout/gen_tokens_p95": _pct(gen_sorted, 0.95),
        "rollout/gen_tokens_max": float(max(gen_len)),
        "rollout/input_tokens_mean": statistics.fmean(in_len),
        "rollout/total_tokens_mean": statistics.fmean(tot_len),
        "rollout/total_tokens_max": float(max(tot_len)),
        "rollout/turns_per_sample_mean": turns_mean,
        # agent episodes whose history was rewritten: segments beyond the first (only the last is trained)
        "rollout/agent_segment_breaks": float(breaks),
        "rollout/env_s_mean": statistics.fmean(env_s),
        "rollout/env_s_max": max(env_s),
        "rollout/generate_s_mean": gen_s_mean,
        "rollout/generate_s_max": gen_s_max,
        "rollout/dispatched_groups": float(rs.dispatched_groups),
        "rollout/committed_groups": float(rs.committed_groups),
        "rollout/aborted_groups": float(rs.aborted_groups),
        "rollout/aborted_stale_inflight_groups": float(ledger.stale_aborted_groups),
        "rollout/evicted_groups": float(ts.evicted_groups),
        "rollout/dropped_groups": float(rs.dropped_groups),
        "rollout/replaced_groups": float(rs.replaced_groups),
        "rollout/infra_retries": float(rs.infra_retries),
        "rollout/data_retries": float(rs.data_retries),
        "rollout/wasted_samples": float(ledger.wasted_samples),
        "rollout/buffer_live_groups": float(buffer_live),
        "train/step_retries_total": float(ts.train_retries),
        "train/pass_retries_total": float(ts.pass_retries),
        "staleness/mean": statistics.fmean(stal),
        "staleness/max": float(max(stal)),
        "staleness/age_s_mean": statistics.fmean(ages) if ages else 0.0,
        "staleness/age_s_max": max(ages) if ages else 0.0,
        "timing/step_s": step_s,
        "timing/train_idle_s": idle,
        "timing/rollout_idle_s_total": rs.idle_s,
        "throughput/trained_tokens_per_s": sum(gen_len) / step_s if step_s > 0 else 0.0,
        "epoch": float(max(map(_EPOCH, trained)) + 1),  # 1-based, as the workflow's epoch_<k> folders
    }
    m["rollout/refill_groups"] = float(rs.refill_groups)
    m["rollout/dynamic_filtered_groups"] = float(ts.dynamic_filtered_groups)
    m["train/policy_frozen"] = float(policy_frozen)
    for k, v in finalize_metrics(step_pairs or {}).items():  # advantage, shaping, dynamic sampling
        m[k if k.startswith(("shaping/", "dynamic_sampling/")) else f"train/{k}"] = v
    for w, n in sorted(workers.items()):
        m[f"rollout/worker_gen_tokens/{w}"] = float(n)
    for name in _component_names(comp_groups):  # named reward components (multi-reward)
        m[f"reward/{name}"] = statistics.fmean(DictColumns.joined(comp_groups, name, 0.0))
    for k, v in train_metrics.items():
        m[k if k.startswith(("critic/", "flops/", "perf/", "recovery/")) else f"train/{k}"] = v
    for k, v in refit_metrics.items():
        m[f"refit/{k}"] = v
    if gc_clock is not None:  # the garbage collector's time since the last step (metrics.gc_pauses)
        m.update({f"timing/{k}": v for k, v in gc_clock.take().items()})
    m["_histograms"] = {"rollout/gen_tokens": gen_len, "rollout/input_tokens": in_len, "rollout/total_tokens": tot_len}
    return m
