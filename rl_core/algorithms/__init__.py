"""The algorithm library: pure tensor functions tested against hand-computed values.

- `advantages`: GRPO, GDPO, REINFORCE++, raw reward (one advantage per sample);
- `gae`: GAE advantages and returns for PPO (per token);
- `estimate`: `estimate_advantages`, the per-chunk dispatch (KL in the reward, critic values);
- `losses`: clipped PG (dual clip, GSPO sequence ratio), REINFORCE; `make_loss`;
- `offpolicy`: importance weights (tis, icepop, seq-mask-tis), logprob-error masking, metrics;
- `kl`: k1/k2/k3 estimators (loss term or reward penalty);
- `value_loss`: the critic's clipped value loss;
- `shaping`: overlong filtering and penalty, reward scaling, dynamic-sampling predicate;
- `flops`: training FLOPs and MFU;
- `metrics`: the (sum, count) metric convention and its reduction across chunks.
"""
