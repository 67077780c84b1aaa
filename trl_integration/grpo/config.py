"""``SafeVocabGRPOConfig``: trl's ``GRPOConfig`` plus the safe-vocabulary, rollout and mismatch settings.

A leaf: the values it accepts come from :mod:`trl_integration.options` (``OUT_OF_SET_MODES`` and ``SCORING_MODES``
stay importable from here), numeric checks from :mod:`safevocab.validation`; it imports no implementation module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import trl

from safevocab import SafeVocabRule, parse_rule
from safevocab.effective_rule import sampler_rule
from safevocab.schedulers import SurgeDetector
from trl_integration.grpo.checks import (
    bf16_supported,
    check_length_decay,
    check_mismatch_lab,
    check_report_to,
    check_rollout_paths,
    check_safe_vocab_fields,
    warn_on_sampler_rule_mismatch,
)
from trl_integration.grpo.field_help import fill_field_help
from trl_integration.grpo.generation_settings import refuse_settings_trls_engine_lacks
from trl_integration.grpo.loss_types import check_loss_type
from trl_integration.grpo.sampler_settings import compose_with_sampler, resolve_rollout_logprobs
from trl_integration.grpo.value_checks import check_config_values, parse_bool_fields
from trl_integration.options import (
    DEFAULT_BUCKETS,
    DEFAULT_MAX_CHUNK_BYTES,
    EMPTY_STEP_ACTIONS,
    LENGTH_DECAY_STARTS,
    LENGTH_SURGE_BASELINES,
    NOISE_KINDS,
    OUT_OF_SET_MODES,
    ROLLOUT_DTYPES,
    SCORING_MODES,
    SUPPORT_SOURCES,
)
from trl_integration.trl_version import check_trl_version

# outside the tested trl range: one line at import, before trl's config (and transformers' Trainer stack with it) loads
check_trl_version(trl.__version__)

from trl import GRPOConfig  # noqa: E402

__all__ = ["SafeVocabGRPOConfig", "OUT_OF_SET_MODES", "SCORING_MODES", "DEFAULT_RULE"]

#: Default safe-vocabulary rule (see docs/trl.md, "Choosing the rule", for why).
DEFAULT_RULE = "min_p=0.001"


@fill_field_help  # each field's --help is its docstring entry below: one description, not two copies
@dataclass
class SafeVocabGRPOConfig(GRPOConfig):
    r"""Configuration of :class:`~trl_integration.grpo.trainer.SafeVocabGRPOTrainer`.

    Everything of trl's ``GRPOConfig`` applies. The fields below add Dynamic Vocabulary Pruning: the policy, old
    policy and reference log-probabilities are ``log pi_S`` renormalised over a per-position safe set ``S``
    picked by ``safe_vocab_rule`` on the same transformed logits the sampler uses (logit scale, softcap,
    ``temperature``).

    trl's ``vllm_importance_sampling_correction``, ``vllm_importance_sampling_mode`` and
    ``vllm_importance_sampling_clip_min/max`` drive the importance-sampling correction on *both* rollout paths:
    vLLM, and plain ``generate`` (whose rollout log-probabilities this trainer records, see
    ``rollout_logprobs``).

    Parameters:
        > Parameters that control the safe vocabulary

        safe_vocab_rule (`str`, defaults to `"min_p=0.001"`):
            Safe-vocabulary rule, e.g. `"min_p=0.001"`, `"top_k=50,min_p=0.01"`, `"top_p=0.95"`,
            `"min_prob=1e-4"` or `"none"`. Stored in canonical form; the parsed rule is `config.rule`.
        safe_vocab_out_of_set (`str`, defaults to `"mask_token"`):
            What to do with a sampled token outside the trainer's safe set: `"mask_token"` drops the token from
            the loss, `"mask_sequence"` drops its whole sequence.
        safe_vocab_in_sampler (`bool`, defaults to `True`):
            Sample rollouts with the same rule. Sampler truncation the user sets (`top_k`/`top_p`/`min_p`, as flags
            or in `generation_kwargs`) composes with it: the sampler and the trainer both use the effective rule
            `safe_vocab_rule & sampler rule` (`safe_vocab_effective_rule`, see
            :func:`~safevocab.effective_rule.compose_rules`). With `False` the sampler keeps its own settings
            and the trainer scores with `safe_vocab_rule` alone.
        > Parameters that control the rollouts (the `generate` path)

        rollout_dtype (`str`, defaults to `"auto"`):
            Precision of the `generate` rollouts: `"auto"` (the model's dtype, as trl), `"float32"`, `"bfloat16"`
            or `"float16"` (autocast; the trained weights are not modified).
        rollout_logprobs (`bool` or `None`, defaults to `None`):
            Record the sampled tokens' log-probabilities on the `generate` path (vLLM always returns them), for
            the importance-sampling correction and the mismatch metrics. `None` (auto): on when the effective rule
            or the sampler prunes or a mismatch-lab setting is on, off for rule `"none"` with default settings
            (stock trl). Where they cannot be recorded (no logits-processor loop, beam search, a replaced
            `generate`), the batch trains without them, with one warning per run and the metric
            `safevocab/rollout_logprobs_frac`.
        safe_vocab_effective_rule (`str` or `None`, set by the config):
            The rule the trainer scores with: `safe_vocab_rule` composed with the sampler's own truncation when
            `safe_vocab_in_sampler` (else `safe_vocab_rule`). Computed; a value passed in must equal it.
        > Parameters that control the metrics

        log_mismatch_metrics (`bool`, defaults to `True`):
            Log the `mismatch/*` metrics whenever rollout log-probabilities exist.
        mismatch_buckets (`list[float]`, defaults to `[0.001, 0.01, 0.1, 0.5]`):
            Edges of the probability buckets of the `mismatch/*/p=lo-hi` metrics.
        log_entropy_metrics (`bool`, defaults to `False`):
            Log `safevocab/entropy_full` (the policy's full-softmax entropy, stock trl's `entropy`) and
            `safevocab/entropy_kept` (its entropy over the safe set, this trainer's `entropy`) from the loss's forward;
            the full one costs one more no-grad LM-head pass when the rule prunes (docs/metrics.md).
        > Parameters that control how the trainer scores

        safe_vocab_max_chunk_bytes (`int`, defaults to 64 MiB):
            Scratch memory budget of one chunk of the fused safe log-softmax.
        safe_vocab_keep_logits_bytes (`int`, defaults to `0`):
            Memory the loss's forward may spend keeping the LM-head logits of its first chunks for the backward, which
            then folds them instead of recomputing them: the same gradients, one LM-head GEMM fewer per kept chunk.
            Costs `rows x vocabulary x 2` bytes per kept chunk for bf16/fp16 heads (4 for fp32), held from the loss's
            forward to its backward (8192 scored tokens at a 151936-token vocabulary, bf16: 2.49 GB). `0`: recompute
            (docs/performance.md, "Kept logits").
        safe_vocab_scoring (`str`, defaults to `"auto"`):
            Where the out-of-set masks, the importance ratio and the metrics of a generation batch come from when
            trl scores no old-policy log-probabilities (on-policy: one iteration per generation, no vLLM
            importance sampling). `"loss_forward"`: from the loss's own forward pass, per micro-batch, at no
            extra cost; `"separate"`: from one more no-grad forward over the generation batch right after the
            rollout (trl's old-policy pass); `"auto"`: `"loss_forward"` where it is exact, else `"separate"`.
            It is exact unless a count-normalised loss (`dapo`, `cispo`, `vespo`) splits a generation batch
            into several micro-batches: those divide by `num_items_in_batch`, the loss tokens of the whole
            generation batch, and the out-of-set tokens of the micro-batches not yet run are unknown, so
            `"loss_forward"` then divides by the count before out-of-set masking (a relative difference of
            `safevocab/masked_token_frac`). Off-policy batches always reuse trl's old-policy pass.
        safe_vocab_support (`str`, defaults to `"rule"`):
            `"rule"` recomputes each position's safe set with the rule; `"replay"` renormalises over the engine's kept
            token sets (a `rollout_func`'s `"sampling_mask"`, see docs/trl.md) & the rule; rule fallback, one warning.
        safe_vocab_out_of_set_warn_frac (`float`, defaults to `0.2`):
            Warn (one line, `OutOfSetWarning`: the share, the rule, the sampler's settings and the fixes) when more
            than this share of an optimisation step's completion tokens fall outside the trainer's safe set and are
            masked out of the loss (rollouts not sampled under the rule: a `rollout_func`, tools, an external engine):
            the first time, then at most every 50 steps. In [0, 1]; `1` never warns. See docs/trl.md, "Out-of-set
            tokens".
        safe_vocab_empty_step (`str`, defaults to `"error"`):
            An optimisation step whose completion tokens were all masked out of the loss (it trains nothing):
            `"error"` stops the run (`NothingToTrainError`, naming the fixes), `"warn"` warns and trains on.
        > Parameters that control the mismatch lab (injected rollout mismatch, `generate` path). **Experimental**, as
        > the lab is (docs/experimental.md): these fields may change or go in any release without deprecation.

        rollout_logit_noise (`float`, defaults to `0.0`):
            Mismatch lab: a hard bound ε on a seeded perturbation δ (|δ_i| ≤ ε) added to the `generate`
            rollout's transformed logits before the rule and the softmax; tokens are sampled from, and rollout
            log-probabilities recorded under, the perturbed distribution. `0` disables it. Generate path only.
        rollout_logit_noise_kind (`str`, defaults to `"uniform"`):
            Distribution of δ: `"uniform"` (U[-ε, ε]), `"clipped_gaussian"` (N(0, (ε/2)²) clipped to ±ε),
            `"lift"`, deterministic and biased: δ_i = ε·min(1, (z_max − z_i)/10), a heavier rollout tail, or
            `"tail"`: δ_i = ε on exactly the tokens `rollout_tail_rule` cuts at the rollout's logits, 0 elsewhere.
        rollout_tail_rule (`str` or `None`, defaults to `None`):
            The rule whose cut tokens `"tail"` lifts (e.g. `"min_p=0.01"`: z_max − z_i > ln 100); unset:
            `safe_vocab_rule`. A rule that cuts nothing (`"none"`) is refused with `"tail"`.
        rollout_noise_seed (`int`, defaults to `0`):
            Seed of the noise's private generator (plus the process index), independent of the sampling RNG.
        rollout_mantissa_bits (`int` or `None`, defaults to `None`):
            Mismatch lab: the `generate` rollouts sample with the current weights rounded to this many mantissa
            bits (1–23, round to nearest even; 7 = bfloat16's, 10 = float16's), so the mismatch follows the
            weights as they train. The trained weights are restored bit for bit after each rollout (a rounded copy
            is held meanwhile). Generate path only; not with a bfloat16/float16 `rollout_dtype`.
        rollout_perturbation (`str` or `None`, defaults to `None`):
            Mismatch lab: `"module:function"`, a factory `function(seed: int) -> LogitsProcessor` (seed:
            `rollout_noise_seed` + the process index). The processor sees the `generate` rollout's scores
            before the temperature warper and the rollout log-prob recorder, after the injected noise: tokens are
            sampled from, and recorded under, the distribution it returns. `SafeVocabGRPOTrainer` also takes the
            factory or a processor itself (`rollout_perturbation=`). Generate path only.
        zero_mismatch (`bool`, defaults to `False`):
            Mismatch lab: replace the rollout log-probabilities by the training engine's own scoring of the
            sampled tokens, so that rollout and training log-probabilities are bit-identical (importance ratio
            exactly 1, every `mismatch/*` gap exactly 0). The gap measured before the replacement is logged
            under `mismatch/removed/*`. The tokens are still sampled by `generate`, whose float-level
            differences stay in the sampling itself (see docs/mismatch.md). Generate path only.
        > Parameters that control the length-decay learning rate (docs/length_decay.md)

        length_decay (`bool`, defaults to `False`):
            Multiply the LR schedule by the length-decay factor (:class:`~safevocab.schedulers.LengthDecayLR`): 1 until
            the mean response length surges, then halved every `length_decay_period` steps down to
            `length_decay_min_lr_ratio`. The schedule is trl's own (`lr_scheduler_type`, warm-up,
            `lr_scheduler_kwargs`); trl's default is `"linear"`: `lr_scheduler_type="constant"` holds the LR until
            the surge (the behaviour before length decay composed with schedules, whose checkpoints it resumes).
        length_decay_period (`str`, defaults to `"auto"`):
            Steps between halvings: an integer >= 1, or `"auto"` = `round(length_surge_factor × surge step)`, the step
            at which the length surge started (the paper's rule).
        length_decay_min_lr_ratio (`float`, defaults to `0.1`):
            Floor of the factor, in [0, 1]: the LR never falls below this fraction of the schedule's.
        length_decay_start (`str`, defaults to `"on_surge"`):
            `"on_surge"`: hold the factor at 1 until the surge detector fires; `"step0"`: halve from the first step
            (the paper's Algorithm 1; needs an integer `length_decay_period`).
        length_decay_max_decays (`int`, defaults to `1`):
            Cap on the decays: the start, then each later surge the detector reports, which halves the factor at
            once. 1: the start only (the paper's algorithm).
        length_decay_cooldown (`int`, defaults to `0`):
            Steps after a decay before the next one is accepted (needs `length_decay_max_decays` >= 2).
        length_surge_window (`int`, defaults to `10`):
            Surge detector: the recent generation steps whose median length is compared with the baseline (>= 1).
        length_surge_baseline_window (`int`, defaults to `30`):
            Surge detector: the steps before the recent ones forming the baseline (>= 1).
        length_surge_ratio (`float`, defaults to `1.5`):
            Surge detector: the recent median / baseline that counts as a surge (> 1).
        length_surge_warmup (`int`, defaults to `20`):
            Surge detector: no detection before this many generation steps.
        length_surge_factor (`float`, defaults to `1.8`):
            `"auto"` period = `round(factor × surge step)` (the paper's 1.8).
        length_surge_baseline (`str`, defaults to `"median"`):
            Surge detector baseline: `"median"` of the `length_surge_baseline_window` lengths before the recent ones,
            or `"ema"`, an exponential moving average of every length before them.
        length_surge_ema_alpha (`float` or `None`, defaults to `None`):
            The EMA coefficient in (0, 1] with `length_surge_baseline="ema"`; unset: `2 / (baseline_window + 1)`.

        > Parameters of the run harness (`HardenedSafeVocabGRPOTrainer`, what `safevocab-grpo` trains with; the plain
        > `SafeVocabGRPOTrainer` ignores them: trl's own behaviour)

        safe_vocab_print_metrics (`bool`, defaults to `False`):
            Also print the project's metrics (`safevocab/*`, `mismatch/*`, `length_decay/*`, `lr_base`) in the
            per-step console output. They are always in the logged history (`trainer.state.log_history`), the run
            summary and the `report_to` integrations; the console shows the keys stock trl prints unless this is on
            (:mod:`trl_integration.harness.console_log`).
        choose_torch_threads (`bool`, defaults to `True`):
            On CPU, choose torch's intra-op thread count when the trainer is built (one thread for a model under 1M
            parameters or a busy machine; `OMP_NUM_THREADS` or an earlier `torch.set_num_threads` is kept), before a
            colocated vLLM engine is built, and log one line saying which and why
            (:mod:`trl_integration.harness.threads`). `False` leaves torch's count as it is.
        resume_allow_missing_state (`bool`, defaults to `False`):
            Resume from a checkpoint that lacks `optimizer.pt`, `scheduler.pt` (or its length-decay state),
            `rng_state.pth` (`rng_state_<rank>.pth` per process) or `scaler.pt` (with fp16): by default such a
            checkpoint is refused, naming the missing files; with `True` it is accepted with a warning naming what
            starts fresh (see :mod:`trl_integration.harness.checkpoints`).
        resume_allow_changed_settings (`list[str]`, defaults to `[]`):
            Settings a resume may change on purpose (stored per checkpoint in `safevocab_settings.json`): a changed
            `safe_vocab_rule`, `safe_vocab_effective_rule`, `rule_engine`, `length_decay*`/`length_surge_*` setting or
            model (`model_config_class`, `model_vocab_size`, `model_hidden_size`, `model_num_parameters`) is refused
            unless named here. A changed `learning_rate` (the new LR scales the restored schedule), schedule or
            `max_steps` is honoured with a warning; `max_steps` below the checkpoint's step is refused
            (:mod:`trl_integration.harness.resume_settings`).
        resume_verify_checksums (`bool`, defaults to `True`):
            Verify a checkpoint's files against its `safevocab_manifest.json` (each file's size and CRC-32, written at
            save) before resuming: a file changed since (a flipped byte, a partial copy) is refused in one line naming
            it. `False`: resume without verifying, for checkpoints edited by hand (:mod:`trl_integration.harness.manifest`).
        safe_vocab_atomic_checkpoints (`bool`, defaults to `True`):
            Publish each checkpoint with one rename (a kill or full disk leaves it whole or absent); `False`: in place.
        safe_vocab_check_rewards (`bool`, defaults to `True`):
            Refuse, naming the function, a reward output that is not one number per completion (a string, a dict, a
            set), infinite, or large enough to overflow trl's float32 group mean/std (:mod:`trl_integration.harness.rewards`).
    """

    safe_vocab_rule: str = field(default=DEFAULT_RULE)
    safe_vocab_out_of_set: str = field(default="mask_token", metadata={"choices": list(OUT_OF_SET_MODES)})
    safe_vocab_in_sampler: bool = field(default=True)
    rollout_dtype: str = field(default="auto", metadata={"choices": list(ROLLOUT_DTYPES)})
    rollout_logprobs: bool | None = field(default=None)
    safe_vocab_effective_rule: str | None = field(default=None)
    log_mismatch_metrics: bool = field(default=True)
    mismatch_buckets: list[float] = field(default_factory=lambda: list(DEFAULT_BUCKETS))
    log_entropy_metrics: bool = field(default=False)
    safe_vocab_max_chunk_bytes: int = field(default=DEFAULT_MAX_CHUNK_BYTES)
    safe_vocab_keep_logits_bytes: int = field(default=0)
    safe_vocab_scoring: str = field(default="auto", metadata={"choices": list(SCORING_MODES)})
    safe_vocab_support: str = field(default="rule", metadata={"choices": list(SUPPORT_SOURCES)})
    safe_vocab_out_of_set_warn_frac: float = field(default=0.2)
    safe_vocab_empty_step: str = field(default="error", metadata={"choices": list(EMPTY_STEP_ACTIONS)})

    # --- mismatch lab (docs/mismatch.md); experimental, like trl_integration.lab ----------------------
    rollout_logit_noise: float = field(default=0.0)
    rollout_logit_noise_kind: str = field(default="uniform", metadata={"choices": list(NOISE_KINDS)})
    rollout_tail_rule: str | None = field(default=None)
    rollout_noise_seed: int = field(default=0)
    rollout_mantissa_bits: int | None = field(default=None)
    rollout_perturbation: str | None = field(default=None)
    zero_mismatch: bool = field(default=False)

    length_decay: bool = field(default=False)
    length_decay_period: str = field(default="auto")
    length_decay_min_lr_ratio: float = field(default=0.1)
    length_decay_start: str = field(default="on_surge", metadata={"choices": list(LENGTH_DECAY_STARTS)})
    length_decay_max_decays: int = field(default=1)
    length_decay_cooldown: int = field(default=0)
    length_surge_window: int = field(default=10)
    length_surge_baseline_window: int = field(default=30)
    length_surge_ratio: float = field(default=1.5)
    length_surge_warmup: int = field(default=20)
    length_surge_factor: float = field(default=1.8)
    length_surge_baseline: str = field(default="median", metadata={"choices": list(LENGTH_SURGE_BASELINES)})
    length_surge_ema_alpha: float | None = field(default=None)

    # --- the run harness (trl_integration.harness; the plain trainer ignores these) --------------------------------
    safe_vocab_print_metrics: bool = field(default=False)
    choose_torch_threads: bool = field(default=True)
    resume_allow_missing_state: bool = field(default=False)
    resume_allow_changed_settings: list[str] = field(default_factory=list)
    resume_verify_checksums: bool = field(default=True)
    safe_vocab_atomic_checkpoints: bool = field(default=True)
    safe_vocab_check_rewards: bool = field(default=True)

    def __post_init__(self):
        # Validate our own fields before trl's (cheap, and the errors name what the user typed); booleans first,
        # parsed as the command line parses them (a string "false" is False, never truthy).
        parse_bool_fields(self)
        check_length_decay(self)
        check_safe_vocab_fields(self)
        rule = self._rule
        if isinstance(self.generation_kwargs, str):
            self.generation_kwargs = json.loads(self.generation_kwargs)
        check_config_values(self)  # sampler settings, counts, reward weights, signs trl leaves unchecked
        if self.use_vllm:  # before anything loads: vLLM would refuse it only at the first rollout
            refuse_settings_trls_engine_lacks(self)
        effective = compose_with_sampler(self, rule) if self.safe_vocab_in_sampler else rule
        given = self.safe_vocab_effective_rule
        if given is not None and str(parse_rule(given, engine=self.rule_engine)) != str(effective):
            raise ValueError(
                f"safe_vocab_effective_rule={given!r} is computed by the config, not an input: accepted None or "
                f"{str(effective)!r} (safe_vocab_rule & the sampler's settings)"
            )
        self.safe_vocab_effective_rule = str(effective)
        self._effective_rule = effective
        if self.bf16 is None and not (self.fp16 or self.use_cpu or bf16_supported()):
            self.bf16 = False  # trl reads unset as True, which transformers refuses without a bf16 device

        check_loss_type(self)
        super().__post_init__()

        resolve_rollout_logprobs(self)
        warn_on_sampler_rule_mismatch(self, rule)
        check_rollout_paths(self)
        check_mismatch_lab(self)
        check_report_to(self.report_to)  # transformers would raise only when the Trainer is built

    # ------------------------------------------------------------------------------------------------------
    @property
    def length_decay_auto_period(self) -> bool:
        """Whether the decay period comes from the surge detector (``length_decay_period="auto"``)."""
        return self.length_decay_period == "auto"

    @property
    def length_decay_period_steps(self) -> int | None:
        """The integer ``length_decay_period``, or ``None`` in auto mode."""
        return None if self.length_decay_auto_period else int(self.length_decay_period)

    def make_surge_detector(self) -> SurgeDetector:
        """A fresh :class:`~safevocab.schedulers.SurgeDetector` with the ``length_surge_*`` settings."""
        return SurgeDetector(
            window=self.length_surge_window, baseline_window=self.length_surge_baseline_window,
            ratio=self.length_surge_ratio, warmup=self.length_surge_warmup, factor=self.length_surge_factor,
            baseline=self.length_surge_baseline, ema_alpha=self.length_surge_ema_alpha,
        )  # fmt: skip

    @property
    def rule(self) -> SafeVocabRule:
        """The parsed :attr:`safe_vocab_rule`."""
        return self._parsed("_rule", self.safe_vocab_rule)

    @property
    def effective_rule(self) -> SafeVocabRule:
        """The rule the trainer scores with (:attr:`safe_vocab_effective_rule`, parsed)."""
        return self._parsed("_effective_rule", self.safe_vocab_effective_rule or self.safe_vocab_rule)

    @property
    def rule_engine(self) -> str:
        """The engine whose sampler the rules reproduce, hence their composition order: ``"vllm"`` with
        ``use_vllm`` (min_p -> top_k -> top_p), else ``"hf"`` (transformers' ``generate``: top_k -> top_p -> min_p;
        see :mod:`safevocab.engine_order`)."""
        return "vllm" if self.use_vllm else "hf"

    def _parsed(self, cache: str, text: str) -> SafeVocabRule:
        """``parse_rule(text, engine=rule_engine)``, cached in attribute ``cache`` while the field keeps the same
        text and engine."""
        rule = getattr(self, cache, None)
        if rule is None or str(rule) != text or rule.engine != self.rule_engine:
            rule = parse_rule(text, engine=self.rule_engine)
            setattr(self, cache, rule)
        return rule

    @property
    def sampler_rule(self) -> SafeVocabRule:
        """The rule the rollout sampler applies (from ``top_k``/``top_p``/``min_p`` and ``generation_kwargs``)."""
        gk = self.generation_kwargs if isinstance(self.generation_kwargs, dict) else {}
        return sampler_rule(
            gk.get("top_k", self.top_k),
            gk.get("top_p", self.top_p),
            gk.get("min_p", self.min_p),
            engine=self.rule_engine,
        )

    @property
    def generate_path_importance_sampling(self) -> bool:
        """Whether the importance-sampling correction runs on the ``generate`` path (no vLLM)."""
        other_path = self.use_vllm or self.use_transformers_continuous_batching
        return bool(not other_path and self.vllm_importance_sampling_correction and self.rollout_logprobs)
