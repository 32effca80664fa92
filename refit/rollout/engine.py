"""The Engine protocol, the lazy backend registry, and generate/score for every backend over the one
decode loop (:mod:`refit.rollout.decode`).

A backend supplies only the model stepping -- a :class:`StepState` with ``prefill`` (prompt ->
next-token logits) and ``extend`` (more tokens through the KV cache -> their logits). Batching,
padding, stop handling, sampling and the record layout live here, once, so backends differ
only in how logits are computed and parity tests compare exactly that.

``generate(..., on_step=hook)`` is the public timing hook: the shared decode loop calls ``hook``
with a :class:`StepEvent` after the prefill (time to first token) and after every decode step,
so benchmarks time phases without reaching into a backend. A plain argument, not a
``SamplingParams`` field: sampling params are pickled to Ray workers, a callable would not be.

Backends are imported only when asked for (verl's rollout registry): ``tensorrt`` is never
imported on a machine that does not use it.
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol, runtime_checkable

import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.padding import check_left_padded, check_right_padded, pad_batch
from refit.rollout.decode import (StepEvent, StepHook, StepState, decode_loop, on_threads, row_keys, schedule,
                                  shard_bounds)
from refit.rollout.types import ModelSpec, RolloutBatch, SamplingParams, ScoreResult

DEFAULT_SCORE_CHUNK = 64  # positions per score() forward: bounds the (B, chunk, V) log-softmax


@runtime_checkable
class Engine(Protocol):
    """What the learner sees of a generation backend. Prompts are token ids; no tokenizer inside."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 on_step: StepHook | None = None) -> RolloutBatch: ...

    def score(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor, temperature: float = 1.0, topk: int = 0,
              chunk_size: int = DEFAULT_SCORE_CHUNK) -> ScoreResult: ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Load HF-named tensors; ``weights_version`` becomes ``version`` (a resumed run restores the
        checkpoint's) or, by default, the current one + 1 (:func:`next_version`). A push that raises leaves
        ``weights_version`` as it was."""
        ...

    @property
    def weights_version(self) -> int:
        """The version of the weights the engine holds, stamped on every batch it generates: 0 as exported, then
        set by each push (:meth:`update_weights`). The learner's sync room reads it; it counts none of its own."""
        ...

    @property
    def manifest(self) -> Manifest | None:
        """The engine folder's manifest (dtype, quantization, LoRA inputs, weight map): what the learner's probe
        compares with (an fp16/bf16 engine: the learner's weights rounded to its dtype). None for an engine over a
        PyTorch model (``torch``, ``hf``): fp32 weights and arithmetic, no folder."""
        ...

    @property
    def adapter(self) -> object | None:
        """A LoRA-ready engine's adapter inputs, bound into every run (onnxruntime: ``ort_adapter.AdapterSlots``): a
        LoRA policy's push then carries its adapter's tensors only (``<module>.lora_A`` / ``lora_B``). None: pushes
        carry whole weights by HF name (a LoRA policy's adapted layers merged in: TensorRT, a Ray pool)."""
        ...

    def adapter_off(self) -> Engine:
        """This engine with its LoRA adapter off (the base) over the same weights, taking no pushes: PPO's frozen
        reference on a LoRA run. One RefitError line for an engine whose :attr:`adapter` is None."""
        ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- registry

_BACKENDS: dict[str, str] = {
    "torch": "refit.rollout.torch_backend:TorchEngine",
    "onnxruntime": "refit.rollout.ort_backend:OrtEngine",
    "tensorrt": "refit.rollout.tensorrt.engine:TrtEngine",
    "hf": "refit.rollout.hf_backend:HFGenerateEngine",  # transformers generate(): the baseline in benchmarks
}


def register_backend(name: str, target: str) -> None:
    """Register ``name`` -> ``"module:Class"``; the module is imported by :func:`create_engine` only."""
    if ":" not in target:
        raise ValueError(f"backend target must be 'module:Class', got {target!r}")
    _BACKENDS[name] = target


def backends() -> list[str]:
    return sorted(_BACKENDS)


def create_engine(backend: str, path, **kw) -> Engine:
    """Instantiate a registered backend on an engine folder (or, for ``torch``, a model folder)."""
    if backend not in _BACKENDS:
        raise RefitError(f"unknown backend {backend!r}; known: {', '.join(backends())}")
    module_name, cls_name = _BACKENDS[backend].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RefitError(f"backend {backend!r} is not available here: {e}") from None
    return getattr(module, cls_name)(path, **kw)


# ----------------------------------------------------------------------------- checks


def check_prompts(prompts, max_len: int | None, max_new_tokens: int, vocab_size: int | None = None) -> None:
    """Raise RefitError (one line) for no prompts, an empty prompt, bad ids, or too long a prompt."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise RefitError("no prompts given: pass a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise RefitError(f"prompt {i} is empty: every prompt needs at least one token")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise RefitError(f"prompt {i} has a token id outside [0, {vocab_size})")
        if max_len is not None and len(p) + max_new_tokens > max_len:
            raise RefitError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                             f"the engine's max_len={max_len} (shorten it or re-export with a larger --max-len)")


def next_version(current: int, version: int | None) -> int:
    """The ``weights_version`` after a push: ``version`` when given (it may not go back), else ``current + 1``."""
    if version is None:
        return current + 1
    if version < current:
        raise RefitError(f"update_weights: version {version} is older than the engine's {current}")
    return int(version)


def check_version(batch: RolloutBatch, expected_version: int) -> None:
    """Raise RefitError when ``batch`` was generated with other weights than ``expected_version``."""
    if batch.weights_version != expected_version:
        raise RefitError(f"stale rollout: batch has weights_version {batch.weights_version}, "
                         f"the learner expects {expected_version} (push weights before generating)")


def resolve_names(named: dict[str, torch.Tensor], canonical: set[str], tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """HF state_dict names -> canonical names (tied aliases folded in).

    Unknown names, and a tied alias given next to its canonical name with other values, raise
    RefitError: every backend must see the same single tensor.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, t in named.items():
        canon = tied.get(name, name)
        if canon not in canonical:
            unknown.append(name)
        elif canon in out and not (out[canon] is t or torch.equal(out[canon], t)):
            raise RefitError(f"update_weights: {name} and {canon} are one tied tensor but were given different values")
        else:
            out[canon] = t
    if unknown:
        raise RefitError(f"update_weights: {len(unknown)} names are not engine weights, e.g. {unknown[:3]}")
    return out


# ----------------------------------------------------------------------------- shared loops


def pad_prompts(prompts: list[list[int]], n: int, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Repeat each prompt n times (prompt-major) and pad: (ids (B,Tp), mask (B,Tp), prompt_index (B,))."""
    rows = [list(p) for p in prompts for _ in range(n)]
    ids, mask = pad_batch(rows, spec.pad_id, spec.prompt_side)
    index = torch.arange(len(prompts), dtype=torch.int64).repeat_interleave(n)
    return torch.from_numpy(ids), torch.from_numpy(mask), index


def run_generate(new_state: Callable[[], StepState], spec: ModelSpec, prompts: list[list[int]],
                 sampling: SamplingParams, version: int, on_step: StepHook | None = None,
                 slots: int | None = None, inflight: bool = True, shards: int = 1) -> RolloutBatch:
    """Engine.generate for any backend: check, pad, decode, pack into a checked RolloutBatch.

    ``slots`` < rows decodes at most that many rows at once (refit.rollout.decode.schedule): in flight on a
    state that supports slots, else in static batches of ``slots``. ``shards`` > 1 decodes the rows in that many
    shards on as many threads, ``new_state(shard)`` each. The rows are the same either way.
    """
    if not isinstance(sampling, SamplingParams):
        raise RefitError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    check_prompts(prompts, spec.max_len, sampling.max_new_tokens, spec.vocab_size)
    if sampling.return_topk > spec.vocab_size or sampling.top_k > spec.vocab_size:
        raise RefitError(f"top_k/return_topk ({sampling.top_k}/{sampling.return_topk}) exceed the vocabulary "
                         f"({spec.vocab_size})")
    ids, mask, index = pad_prompts(prompts, sampling.n, spec)
    # no_grad, not inference_mode: inference tensors would break the learner's autograd later
    with torch.no_grad():
        out = schedule(new_state, ids, mask, sampling, spec, row_keys(index, sampling.n), slots, inflight, on_step,
                       shards)
    batch = RolloutBatch(prompt_ids=ids, prompt_mask=mask, prompt_index=index, weights_version=version,
                         sampling=sampling, is_seq2seq=spec.kind == "seq2seq", pad_id=spec.pad_id,
                         eos_id=spec.eos_id, **out)
    return batch.check()


class LoopEngine:
    """The Engine methods every loop-driven backend shares; a backend supplies only what differs.

    A subclass sets ``spec`` (:class:`ModelSpec`) and ``_version`` in ``__init__`` and defines
    ``_new_state(capacity)`` -> a fresh :class:`StepState` (``capacity``: tokens per row the call may
    hold, for a backend that preallocates its KV buffer; the others ignore it). Optional: ``slots``
    and ``inflight`` (see :func:`run_generate`); ``max_batch``, the most rows one run of the model takes (the
    engine's shape profiles): a call with more rows runs within it, ``generate`` through at most ``max_batch``
    slots (in flight where the state supports it, else, or with an ``on_step`` hook, static batches, each reporting
    its phases) and ``score`` in row ranges of at most
    ``max_batch``, the rows the same as in one call (each row has its own stream, positions and cache;
    tests/test_rollout.py); ``shards`` > 1 with ``_new_state(capacity, shard)`` giving each shard a state over
    buffers of its own, for a backend whose steps may run on several threads at once. ``update_weights`` and
    ``close`` stay the backend's own; the :class:`Engine` protocol remains the public contract.
    """

    spec: ModelSpec
    _version: int = 0
    slots: int | None = None  # at most this many rows decoded at once; None: all rows in one batch
    inflight: bool = True  # with slots: refill a slot as soon as its row stops; False: static batches
    max_batch: int | None = None  # most rows one run of the model takes; more are split within it; None: no limit
    shards: int = 1  # generate() decodes its rows in this many shards, one thread each (decode.schedule)
    manifest: Manifest | None = None  # the engine folder's (Engine.manifest); None: a PyTorch model, no folder
    adapter: object | None = None  # a LoRA-ready engine's adapter inputs (Engine.adapter); None: whole weights

    def _new_state(self, capacity: int = 0) -> StepState:
        raise NotImplementedError

    def _slots(self, rows: int) -> int | None:
        """The slots a call of ``rows`` rows decodes through: ``slots``, at most ``max_batch``."""
        if self.max_batch is None or rows <= self.max_batch:
            return self.slots
        return min(self.slots or rows, self.max_batch)

    @property
    def weights_version(self) -> int:
        return self._version

    def adapter_off(self) -> Engine:
        """Engine.adapter_off: refused here, the backend has no adapter inputs (a LoRA-ready one overrides it)."""
        raise RefitError(f"adapter_off: this {type(self).__name__} takes no LoRA adapter inputs (its adapter is None)")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams = SamplingParams(),
                 on_step: StepHook | None = None) -> RolloutBatch:
        # capacity computed when a state is made: run_generate has checked prompts and sampling by then
        def new_state(shard: int = 0) -> StepState:
            cap = max(len(p) for p in prompts) + sampling.max_new_tokens
            return self._new_state(cap, shard) if self.shards > 1 else self._new_state(cap)

        rows = len(prompts) * getattr(sampling, "n", 1) if isinstance(prompts, (list, tuple)) else 0
        split = self.max_batch is not None and rows > self.max_batch
        # split within max_batch with a timing hook: static batches, each reporting its phases (in flight reports none)
        return run_generate(new_state, self.spec, prompts, sampling, self._version, on_step, self._slots(rows),
                            self.inflight and not (split and on_step is not None), self.shards)

    def score(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor, temperature: float = 1.0, topk: int = 0,
              chunk_size: int = DEFAULT_SCORE_CHUNK) -> ScoreResult:
        b = int(prompt_ids.shape[0])
        if self.max_batch is not None and b > self.max_batch and response_ids.shape[0] == b:  # within the engine
            step = self.max_batch
            parts = [self.score(prompt_ids[lo:lo + step], prompt_mask[lo:lo + step], response_ids[lo:lo + step],
                                response_mask[lo:lo + step], temperature, topk, chunk_size) for lo in range(0, b, step)]
            return join_scores(parts, topk == self.spec.vocab_size)
        cap = prompt_ids.shape[-1] + response_ids.shape[-1]
        # even row ranges (every row a cut point for shard_bounds), one thread each, joined in row order; rows that
        # disagree in number go to run_score whole, which refuses them in one line
        ranges = shard_bounds([(r, 0) for r in range(b)], self.shards) if response_ids.shape[0] == b else []
        if len(ranges) > 1:
            def score_range(i: int, lo: int, hi: int) -> Callable[[], ScoreResult]:
                return lambda: run_score(lambda: self._new_state(cap, i), self.spec, prompt_ids[lo:hi],
                                         prompt_mask[lo:hi], response_ids[lo:hi], response_mask[lo:hi], temperature,
                                         topk, chunk_size)

            parts = on_threads([score_range(i, lo, hi) for i, (lo, hi) in enumerate(ranges)])
            return join_scores(parts, topk == self.spec.vocab_size)
        return run_score(lambda: self._new_state(cap), self.spec, prompt_ids, prompt_mask, response_ids,
                         response_mask, temperature, topk, chunk_size)


def join_scores(parts: list[ScoreResult], whole_vocab: bool) -> ScoreResult:
    """Row ranges' ScoreResults joined in order (a whole-vocabulary result's ``topk_ids`` stays a broadcast view)."""
    def cat(name):
        ts = [getattr(r, name) for r in parts]
        return None if ts[0] is None else torch.cat(ts)

    out = ScoreResult(logprobs=cat("logprobs"), topk_logprobs=cat("topk_logprobs"))
    if parts[0].topk_ids is not None:
        out.topk_ids = (parts[0].topk_ids[:1].expand(out.logprobs.shape[0], *parts[0].topk_ids.shape[1:])
                        if whole_vocab else cat("topk_ids"))
    return out


def _check_score_padding(spec: ModelSpec, prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> None:
    """score() inputs must follow the padding rule (types.py); one RefitError line otherwise."""
    try:
        (check_left_padded if spec.prompt_side == "left" else check_right_padded)(prompt_mask)
        if (prompt_mask.sum(-1) == 0).any():
            raise ValueError("a prompt row has no real tokens")
        check_right_padded(response_mask)
    except ValueError as e:
        raise RefitError(f"score: {e} (the padding rule: {spec.prompt_side}-padded prompts, "
                         "right-padded responses)") from None


def run_score(new_state: Callable[[], StepState], spec: ModelSpec, prompt_ids: torch.Tensor,
              prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor,
              temperature: float = 1.0, topk: int = 0, chunk_size: int = DEFAULT_SCORE_CHUNK) -> ScoreResult:
    """Engine.score for any backend: prefill the prompt, then the response in chunks through the cache.

    Only (B, chunk_size, V) logits exist at a time; log-probs are of the plain policy
    log_softmax(logits / temperature), 0.0 where ``response_mask`` is 0.
    ``topk`` equal to the vocabulary size returns the whole distribution without a sort: log-probs in
    vocabulary order and ``topk_ids`` a broadcast view of ``arange(V)`` (no (B, Tr, V) int64 tensor).
    """
    if temperature <= 0 or chunk_size < 1 or not 0 <= topk <= spec.vocab_size:
        raise RefitError(f"score: need temperature > 0, chunk_size >= 1, 0 <= topk <= {spec.vocab_size} "
                         f"(got {temperature}, {chunk_size}, {topk})")
    resp, rmask = response_ids.long(), response_mask.float()
    b, tr = resp.shape
    if prompt_ids.shape[0] != b or rmask.shape != resp.shape or prompt_mask.shape != prompt_ids.shape:
        raise RefitError(f"score: shapes disagree: prompt {tuple(prompt_ids.shape)}/{tuple(prompt_mask.shape)}, "
                         f"response {tuple(resp.shape)}/{tuple(rmask.shape)}")
    _check_score_padding(spec, prompt_mask, rmask)
    if tr == 0:
        empty = torch.zeros(b, 0)
        return ScoreResult(logprobs=empty, topk_logprobs=torch.zeros(b, 0, topk) if topk else None,
                           topk_ids=torch.zeros(b, 0, topk, dtype=torch.int64) if topk else None)
    lps, tk_lp, tk_ids = [], [], []
    # topk = V: the whole distribution, written chunk by chunk into its (B, Tr, V) result (no cat, no masked copy)
    full = torch.empty(b, tr, spec.vocab_size) if topk == spec.vocab_size else None
    with torch.no_grad():
        state = new_state()
        logits = state.prefill(prompt_ids.long(), prompt_mask.long())[:, None]  # (B, 1, V) -> token 0
        pos = 0
        while True:
            lp = torch.log_softmax(logits.float() / temperature, -1)  # (B, c, V), c <= chunk_size
            c = lp.shape[1]
            lps.append(lp.gather(-1, resp[:, pos:pos + c, None]).squeeze(-1))
            if full is not None:  # every token: no sort, no ids
                full[:, pos:pos + c] = lp
            elif topk:
                v, i = lp.topk(topk, dim=-1)
                tk_lp.append(v)
                tk_ids.append(i)
            pos += c
            if pos >= tr:
                break
            # feed response tokens pos-1 .. : their logits predict tokens pos ..
            feed = slice(pos - 1, min(pos - 1 + chunk_size, tr - 1))
            logits = state.extend(resp[:, feed], rmask[:, feed].long())
    logprobs = torch.cat(lps, 1) * rmask
    if not topk:
        return ScoreResult(logprobs=logprobs)
    on = rmask[..., None] > 0
    if topk == spec.vocab_size:
        return ScoreResult(logprobs=logprobs, topk_logprobs=full.mul_(on),
                           topk_ids=torch.arange(topk).expand(b, tr, topk))
    return ScoreResult(logprobs=logprobs, topk_logprobs=torch.cat(tk_lp, 1) * on,
                       topk_ids=torch.where(on, torch.cat(tk_ids, 1), spec.pad_id))


__all__ = ["Engine", "LoopEngine", "ModelSpec", "StepEvent", "StepHook", "StepState", "backends", "check_prompts",
           "check_version", "create_engine", "decode_loop", "next_version", "pad_prompts", "register_backend",
           "resolve_names", "run_generate", "run_score"]
