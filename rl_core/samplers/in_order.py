"""The `in_order` sampler: step s trains exactly the groups dispatched for step s.

Owns: stamping each dispatched group with its target step (dispatch order, one step =
`num_prompts_per_step` groups), the admission gate (step s dispatches once the trainer holds
version s - L, L = `max_lookahead_versions`, so staleness <= L; 0 is synchronous), selection
(the current step's ready groups); adaptive L (`observe(step, metrics)` after step t decides
the bound of versions >= t + 1, dispatch at version v uses `lookahead_at(v)`, and
`admitted_bound` records per step the largest bound admitted: exact whatever the
interleaving); and partial rollouts (`carry_over` pairs a straggler of s with a ready group of
a later step t, whose steps the train pump swaps, while t - its dispatch version stays within
`partial_rollouts.max_staleness_versions`).

Does not own: the buffer (it only reads slots), waiting (the pumps wait on its answers). Read
more: docs/controller.md, "Samplers" and "Partial rollouts".
"""

from __future__ import annotations

from rl_core.buffer.replay_buffer import ReplayBuffer, Slot
from rl_core.samplers.adaptive import AdaptiveBound
from rl_core.samplers.base import BaseSampler


class InOrderSampler(BaseSampler):
    name = "in_order"
    stamps = True

    @classmethod
    def from_recipe(cls, cfg) -> "InOrderSampler":
        return cls(cfg.async_rl.sampler, cfg.grpo.num_prompts_per_step, reproducible=cfg.async_rl.reproducible)

    def __init__(self, cfg, num_prompts_per_step: int, reproducible: bool = False):
        self.cfg = cfg
        self.adaptive = AdaptiveBound(cfg.adaptive, cfg.max_lookahead_versions) if cfg.adaptive.enabled else None
        super().__init__(num_prompts_per_step, self.lookahead)
        self.reproducible = reproducible
        self._bound = cfg.max_lookahead_versions  # bound of versions >= _since
        self._prev_bound = cfg.max_lookahead_versions  # bound of versions < _since
        self._since = 0
        self.admitted_bound: dict[int, int] = {}  # target step -> largest bound its groups were admitted under
        pr = getattr(cfg, "partial_rollouts", None)
        self.carry_bound: int | None = pr.max_staleness_versions if pr is not None and pr.enabled else None

    @property
    def lookahead(self) -> int:
        """The largest bound ever used (`InOrderSamplerConfig.largest_lookahead`): sizes the buffer,
        the dispatch limit and the reproducible barrier's reach; the admission gate's window."""
        return self.cfg.largest_lookahead()

    @property
    def staleness_bound(self) -> int:
        """The bound now decided (fixed: max_lookahead_versions; adaptive: the latest decision)."""
        return self._bound

    def lookahead_at(self, version: int) -> int:
        """The bound dispatch uses at weight version `version`."""
        return self._bound if version >= self._since else self._prev_bound

    def can_admit(self, trainer_version: int) -> bool:
        return self.next_target_step() <= trainer_version + self.lookahead_at(trainer_version)

    def admit(self, trainer_version: int) -> int | None:
        step = super().admit(trainer_version)
        b = self.lookahead_at(trainer_version)
        self.admitted_bound[step] = max(b, self.admitted_bound.get(step, b))
        return step

    def observe(self, step: int, metrics: dict) -> dict[str, float]:
        """After RL step `step` trained: decide the bound of versions >= step + 1 (adaptive) and
        return the step's `async/*` metrics."""
        trained = self.admitted_bound.pop(step, self.lookahead_at(step))
        out = {"async/trained_staleness_bound": float(trained)}
        for s in [s for s in self.admitted_bound if s < step]:  # steps that will never train here
            del self.admitted_bound[s]
        if self.adaptive is not None:
            self._prev_bound, self._bound, self._since = self._bound, self.adaptive.update(metrics, trained), step + 1
            out["async/staleness_signal"] = float(metrics[self.adaptive.key])
            out["async/staleness_bound_changes"] = float(self.adaptive.changes)
        out["async/staleness_bound"] = float(self._bound)
        return out

    def select(self, buffer: ReplayBuffer, trainer_version: int, max_groups: int) -> list[Slot]:
        return buffer.ready_for_target(trainer_version)[:max_groups]

    def carry_over(self, buffer: ReplayBuffer, step: int, need: int) -> list[tuple[Slot, Slot]]:
        """Partial rollouts: up to `need` minus the ready groups of `step` pairs (straggler, substitute):
        a group of `step` still generating, earliest dispatched first, and a ready group of the
        earliest later step t such that t - the straggler's dispatch version <= the carry bound.
        The caller swaps their target steps; the bound of step t is raised to the carry bound."""
        if self.carry_bound is None:
            return []
        short = need - len(buffer.ready_for_target(step))
        if short <= 0:
            return []
        stragglers = buffer.reserved_for_target(step)
        if not stragglers:
            return []
        later = sorted(t for t in buffer.ready_targets() if t is not None and t > step)
        pairs: list[tuple[Slot, Slot]] = []
        for t in later:
            for sub in buffer.ready_for_target(t):
                if len(pairs) >= short:
                    return pairs
                fit = next((g for g in stragglers if t - g.start_version <= self.carry_bound), None)
                if fit is None:
                    return pairs  # a later step only adds staleness
                stragglers.remove(fit)
                pairs.append((fit, sub))
                self.admitted_bound[t] = max(self.carry_bound, self.admitted_bound.get(t, 0))
                if not stragglers:
                    return pairs
        return pairs

    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Slot]:
        # a group stamped for a step that already trained (e.g. restored from an older checkpoint)
        old = [t for t in buffer.ready_targets() if t is not None and t < trainer_version]
        if not old:  # the common case, O(1) at every wake-up of the train pump
            return []
        return sorted((s for t in old for s in buffer.ready_for_target(t)), key=lambda s: s.dispatch_index)

    def required_capacity(self) -> int:
        return self.cfg.required_capacity(self.groups_per_step, self.reproducible)

    def state_dict(self) -> dict:
        st = super().state_dict()
        st["bounds"] = {"bound": self._bound, "prev_bound": self._prev_bound, "since": self._since,
                        "admitted": sorted([s, b] for s, b in self.admitted_bound.items())}
        if self.adaptive is not None:
            st["adaptive"] = self.adaptive.state_dict()
        return st

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if (self.adaptive is not None) != ("adaptive" in state):
            raise ValueError("sampler state was saved with async_rl.sampler.adaptive.enabled="
                             f"{'adaptive' in state}, the recipe now says {self.adaptive is not None}; "
                             "resume with the recipe the run was checkpointed with")
        if self.adaptive is not None:
            self.adaptive.load_state_dict(state["adaptive"])
        b = state.get("bounds")  # absent in checkpoints written before adaptive staleness
        if b is not None:
            if self.adaptive is not None:  # a fixed bound is the recipe's, never the checkpoint's
                self._bound, self._prev_bound, self._since = int(b["bound"]), int(b["prev_bound"]), int(b["since"])
            self.admitted_bound = {int(s): int(v) for s, v in b["admitted"]}
