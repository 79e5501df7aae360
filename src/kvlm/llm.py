"""LLM: the offline Python API, shaped like vLLM's (`LLM(...).generate(prompts, params)`)."""

from __future__ import annotations

import hashlib
import logging
import operator
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvlm import defaults, kernels
from kvlm.cache import CacheSpec, KVCache, create_cache
from kvlm.cache.factory import BATCH_MODES, check_mode, mode_spec
from kvlm.config import LIMITS, for_context
from kvlm.dtypes import dtype_name, kv_sides, parse_dtype, parse_kv_dtype
from kvlm.engine.backends import cache_engine_limits
from kvlm.engine.batch import Stream, run_batch
from kvlm.engine.chat import ChatSession
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.request import RequestOutput
from kvlm.engine.runner import ModelRunner
from kvlm.engine.sampling import SamplingParams
from kvlm.engine.scheduler import SchedulerConfig
from kvlm.engine.speculative import DraftModel, SpeculativeConfig, check_mtp
from kvlm.engine.threads import FreeCores
from kvlm.errors import InvalidRequestError, UnsupportedModelError
from kvlm.loading import load_model
from kvlm.model.numerics import ACTIVATIONS, PREFILL_DTYPES, ModelNumerics
from kvlm.model.transformer import Transformer

# The contiguous cache preallocates this many tokens unless told otherwise (the model's
# own limit when smaller). 4096 is llama.cpp's default context too. (`kvlm serve` defaults
# to the model's trained context: kvlm.server.config.serve_model.)
DEFAULT_MAX_CONTEXT = 4096
log = logging.getLogger("kvlm")
# How the projection weights are stored (kvlm.model.transformer.Transformer): None / "f32" =
# in the compute dtype (--dtype); "bf16" = bf16 weights under fp32 activations; "int8",
# "int4" = groups of 32 (kvlm.model.quant); "native" = the GGUF file's own blocks. The
# default, "auto", picks native for a low-bit GGUF (kvlm.defaults).
WEIGHT_FORMATS = (None, "f32", "bf16", "int8", "int4", "native")
# The cache modes speculative decoding cannot run on, and why (the others: in the batch
# engine's pool, or on one cache's own rows, ModelRunner.run with a DraftBatch)
NO_SPECULATION = {
    "off": "it keeps no cache to check a draft against",
}
# Sequences the batch engine decodes together (SchedulerConfig.max_num_seqs)
BATCH_MAX_SEQS = 16
# What the numerics' prefill_dtype and activations may be once resolved (kvlm.defaults)
RESOLVED = {"prefill_dtype": PREFILL_DTYPES, "activations": ACTIVATIONS}


@dataclass(slots=True, frozen=True)
class CacheOptions:
    """Sizes of the mode-specific caches (see kvlm.cache.base.CacheSpec).

    `window_positions`: where the window cache puts RoPE positions, "cache" (counted inside
    the cache, StreamingLLM: distances stay within sinks + window however long the stream)
    or "absolute" (each token's position in the text, for comparison; kvlm.cache.window)."""

    block_size: int = 16
    num_blocks: int | None = None
    window: int = 256
    sinks: int = 4
    window_positions: str = "cache"  # checked by CacheSpec


class LLM:
    """A loaded model with one cache, ready to generate; several prompts at once go
    through a batch engine over a paged pool (`generate`, `batch_engine`).

    >>> llm = LLM()                                  # the embedded SmolLM2-135M
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    >>> out[0].text
    """

    def __init__(
        self,
        model: str | Path | None = None,
        kv: str = "contiguous",
        dtype: str | torch.dtype = "fp32",
        device: str = "cpu",
        kv_dtype: str | torch.dtype | None = None,
        max_context: int | None = None,
        threads: int | None = None,
        progress: bool = True,
        cache_options: CacheOptions | None = None,
        prefill_chunk: int | None = None,
        weights: str | None = "auto",
        prefill_dtype: str = "auto",
        activations: str = "auto",
        exact: bool = False,
        speculative: SpeculativeConfig | str | None = None,
        rope_scaling: str | None = None,
        rope_scale: float | None = None,
        cpu_experts: int | str = 0,
    ) -> None:
        """`weights`, `activations`, `prefill_dtype` and `kv_dtype` default to "auto" (None
        for kv_dtype): the fast path, resolved from the file and the CPU (kvlm.defaults);
        `kv_dtype` names K's and V's storage, or each apart as "K/V" ("int8/q4", either
        side "auto");
        `exact=True` resolves them to the fp32 reference path instead. `speculative`
        ("ngram" or a SpeculativeConfig): every request decodes speculatively, on the batch
        engine's pool or on one cache alike (kvlm.engine.speculative; greedy output
        unchanged; not with kv="off", which keeps nothing to verify against).
        `max_context` past the model's trained context runs, with one warning, RoPE scaled
        by YaRN over it unless `rope_scaling` ("none", "linear", "yarn") and `rope_scale`
        (the factor) say otherwise (kvlm.config.for_context). `cpu_experts` (N, or "all"):
        the routed experts of the first N expert layers kept in host memory and run on the
        CPU kernels beside a GPU, as llama.cpp's --n-cpu-moe (kvlm.model.experts)."""
        self.speculative = _speculative_config(speculative, kv)
        _check_settings(kv, threads, prefill_chunk, weights, kv_dtype)  # before the slow load
        # None: the engine measures how many of torch's threads run fastest while it runs
        # (kvlm.engine.threads: fewer when other work takes the cores)
        self.threads = threads
        # the cores other processes leave free, from the load on: the first request starts
        # on what they allow (kvlm.engine.threads.FreeCores)
        self.free_cores = FreeCores() if threads is None else None
        if threads is not None:
            torch.set_num_threads(threads)
        self.device = _check_device(device)
        self.dtype = parse_dtype(dtype)
        self.cache_options = cache_options or CacheOptions()
        self.prefill_chunk = prefill_chunk
        self.loaded = load_model(model)
        self.numerics = defaults.resolve(
            weights=weights,
            activations=activations,
            prefill_dtype=prefill_dtype,
            kv_dtype=defaults.AUTO if kv_dtype is None else kv_dtype,
            exact=exact,
            fp32_cpu=self.device.type == "cpu" and self.dtype == torch.float32,
            source=self.loaded.weights,
            compute=dtype_name(self.dtype),
        )
        self.weights = _weight_format(self.numerics, self.dtype, self.device)
        self.prefill_dtype = self.numerics.prefill_dtype
        self.activations = self.numerics.activations
        # K's and V's storage: a dtype for both, or a (K, V) pair (--k-dtype, --v-dtype)
        k, v = defaults.kv_dtypes(self.numerics, self.dtype)
        self.kv_dtype = k if k == v else (k, v)
        self.kv_mode = kv
        self.tokenizer = self.loaded.tokenizer
        limit = self.loaded.config.max_position_embeddings
        self.max_context = min(limit, DEFAULT_MAX_CONTEXT) if max_context is None else max_context
        most = LIMITS["max_position_embeddings"][1]
        if not 0 < self.max_context <= most:
            raise InvalidRequestError(f"max_context must be between 1 and {most} tokens "
                                      f"(the model was trained on {limit})")  # fmt: skip
        self.rope = (rope_scaling, rope_scale)  # as asked: a draft model gets the same
        window = kv == "window" and self.cache_options.window_positions == "cache"
        self.config, past = for_context(self.loaded.config, self.max_context, *self.rope, window)
        if past is not None:
            log.warning(past)
        self.cache_spec(kv)  # every cache setting checked before the weights load
        self.cpu_experts = _cpu_experts(cpu_experts, self.config, self.device, self.dtype)
        self._drafters: dict[tuple[str, str | None], DraftModel] = {}  # see draft_model
        self._engine: Engine | None = None  # generate's batch engine, made on first use
        self.progress = progress
        self.model = self._build_model()
        self.fingerprint  # noqa: B018 - read now, while the file's pages are still in
        self.loaded.weights.release()  # the packed weights are the model's own copies now
        self.runner = ModelRunner(self.model)
        if self.speculative is not None and self.speculative.method == "mtp":
            check_mtp(self.model)  # refused now, not at the first request

    def _build_model(self) -> Transformer:
        """The model, its products and prompt attention rounding as resolved (bf16 prompt
        products, int8 / int16 activations in the blocks; the vocabulary projection keeps
        fp32 ones: kvlm.model.layers.Linear)."""
        numerics = ModelNumerics(self.prefill_dtype, self.activations,
                                 self.numerics.attention_bf16_from)  # fmt: skip
        return Transformer(self.config, self.loaded.weights, self.dtype, self.device,
                           self.progress, self.weights, numerics, self.cpu_experts)  # fmt: skip

    @property
    def model_name(self) -> str:
        return self.loaded.path.name

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the weights and the RoPE they run with; cache files and KV tiers carry
        it so another model's K/V (or K rotated by another RoPE scaling) are refused."""
        weights = self.loaded.weights.fingerprint()
        if self.config.rope_scaling == self.loaded.config.rope_scaling:
            return weights
        rope = repr(self.config.rope_scaling).encode()
        return hashlib.sha256(weights.encode() + b"/" + rope).hexdigest()[: len(weights)]

    @cached_property
    def cache(self) -> KVCache:
        """The cache `generate`, `chat` and `stream` run on (each request resets it),
        allocated on first use; assign another to replace it."""
        return self.new_cache()

    def cache_spec(self, mode: str | None = None) -> CacheSpec:
        """The spec of a cache of `mode` (the LLM's by default) for this model."""
        if (mode or self.kv_mode) == "window" and self.config.latent_layers:
            from kvlm.model.mla import KEYS_UNROTATED

            raise UnsupportedModelError(KEYS_UNROTATED)
        o = asdict(self.cache_options)  # CacheSpec's fields of the same names
        spec = CacheSpec.for_model(self.config, self.max_context, self.kv_dtype, self.device, **o)
        return mode_spec(mode or self.kv_mode, spec)

    def new_cache(self, mode: str | None = None) -> KVCache:
        mode = mode or self.kv_mode
        return create_cache(mode, self.cache_spec(mode))

    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of a prompt; with `chat`, wrapped in the model's chat template."""
        if not chat:
            return self.tokenizer.encode(prompt)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return self.tokenizer.encode_chat(messages)

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, prompt: str | None = None
    ) -> Stream:
        """A fresh request on the LLM's cache; iterate it for text as it is generated."""
        return Stream(self.cache_engine(), prompt_ids, params, prompt)

    def cache_engine(
        self, cache: KVCache | None = None, reuse: bool = False, prefill_chunk: int | None = None
    ) -> Engine:
        """An engine over one cache (the LLM's own by default) that runs one request at a
        time: the single stream's engine (kvlm.engine.backends.CacheBackend). `reuse`: a
        request starts from the prefix the cache holds (a conversation's turns; the caller
        rolls the cache back to what the prompt shares). `prefill_chunk`: the LLM's when
        None."""
        cache = self.cache if cache is None else cache
        chunk = prefill_chunk or self.prefill_chunk
        sched = SchedulerConfig(**cache_engine_limits(cache, chunk))
        config = EngineConfig(scheduler=sched, speculative=self.speculative)
        return Engine(self, config, cache=cache, reuse=reuse)

    def draft_model(self, spec: SpeculativeConfig) -> DraftModel:
        """The draft model of `spec` (method "draft": another file with the same tokenizer,
        or this model's own file at a cheaper weight format), its token ids checked to mean
        what this model's mean; loaded once per (file, weights) and shared by every engine
        of this LLM."""
        path = spec.draft_model or str(self.loaded.path)
        key = (path, spec.draft_weights)
        if key not in self._drafters:
            draft = LLM(model=path, weights=spec.draft_weights, max_context=self.max_context,
                        progress=False, rope_scaling=self.rope[0],
                        rope_scale=self.rope[1])  # fmt: skip
            ours = self.tokenizer.backend.get_vocab()
            theirs = draft.tokenizer.backend.get_vocab()
            if ours != theirs:
                raise InvalidRequestError(
                    f"the draft model {path} has another tokenizer ({len(theirs)} tokens "
                    f"against {len(ours)}): its token ids would not mean the served model's",
                    param="draft_model",
                )
            vocab = min(self.config.vocab_size, draft.config.vocab_size)
            self._drafters[key] = DraftModel(draft, vocab)
        return self._drafters[key]

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order (raw text, no chat template; see
        `chat`). `sampling_params`: one for every prompt, or a list of one per prompt.

        More than one prompt, in a cache mode of BATCH_MODES: all go through the batch
        engine (`batch_engine`) together, continuous batching over its paged pool, as the
        server batches requests. Each gets the tokens it gets alone, bit for bit (greedy and
        seeded alike): the engine runs a prompt's forwards as a single stream does and its
        kernels give a row the same bits in any batch. With `speculative` set, one prompt
        goes to the pool too. Otherwise one prompt, every prompt of the window, basic and
        off caches, and a prompt the pool refuses (the whole context; n beyond its rows)
        run one after another on the LLM's own cache (`cache_engine`).

        Every prompt is checked before any is run: an empty one, a token outside the
        vocabulary or a prompt longer than the context raises as it would alone.
        `use_tqdm`: a "Processed prompts" bar on stderr (default: the LLM's `progress`)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else _listed(prompts, PROMPTS_ARE)
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError(PROMPTS_ARE)
            requests = [(t, self.tokenizer.encode(t)) for t in texts]
        else:
            listed = _listed(prompt_token_ids, "prompt_token_ids is a list of lists of ints")
            requests = [(None, _token_ids(ids)) for ids in listed]
        params = self._params_for(sampling_params, len(requests))
        many = len(requests) > 1 or self.speculative is not None  # drafts live in the engine
        batched = many and self.kv_mode in BATCH_MODES
        pool = self.batch_engine() if batched else None
        one: Engine | None = None  # what the pool cannot take runs alone, as it would
        engines: list[Engine] = []  # each prompt checked, once, before any work
        for ids, p in zip((ids for _, ids in requests), params, strict=True):
            try:
                if pool is None:
                    raise InvalidRequestError("no pool")
                pool.check_request(ids, p)
                engines.append(pool)
            except InvalidRequestError:  # a prompt of the whole context; n too large
                one = one or self.cache_engine()
                one.check_request(ids, p)
                engines.append(one)
        show = self.progress if use_tqdm is None else use_tqdm
        with tqdm(total=len(requests), desc="Processed prompts", file=sys.stderr,
                  disable=not show, dynamic_ncols=True) as bar:  # fmt: skip
            results: dict[int, RequestOutput] = {}
            for engine in dict.fromkeys(engines):  # the pool first, then the one cache
                todo = [i for i, e in enumerate(engines) if e is engine]
                outs = run_batch(
                    engine, [requests[i] for i in todo], [params[i] for i in todo], bar
                )
                results.update(zip(todo, outs, strict=True))
        return [results[i] for i in range(len(requests))]

    @staticmethod
    def _params_for(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * count
        params = list(sampling_params)
        if len(params) != count:
            raise InvalidRequestError(
                f"{len(params)} sampling params for {count} prompts: pass one, or one per prompt"
            )
        if not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidRequestError("sampling_params must be SamplingParams")
        return params

    def batch_engine(self) -> Engine:
        """The engine `generate` batches prompts through, made on first use and kept: it
        shares this LLM's model runner (no second copy of the weights) and holds a paged
        pool sized from the LLM's settings (max_context, block size, kv_dtype, --kv int8;
        CacheOptions.num_blocks, else the engine's default of at most 1 GiB, committed when
        it is made).

        It runs each prompt's forwards exactly as a single stream does, so the batch changes
        no bit of any prompt's result: a prompt is prefilled in the LLM's prefill_chunk
        (whole by default), never cut to share a step's budget (SchedulerConfig.chunk_size);
        no prefix is taken from another prompt's blocks (prefix caching off: those were
        computed in other chunks); no sequence is preempted and recomputed
        (SchedulerConfig.reserve_full admits a request only with room for its max_tokens)."""
        if self._engine is None:
            chunk = self.prefill_chunk or self.max_context  # a prompt's chunks, as alone
            sched = SchedulerConfig(
                max_num_seqs=BATCH_MAX_SEQS,
                prefill_chunk=max(chunk, self.max_context),  # a step's prompt tokens
                chunk_size=chunk,
                reserve_full=True,
            )
            config = EngineConfig(
                num_blocks=self.cache_options.num_blocks,
                prefix_caching=False,
                scheduler=sched,
                speculative=self.speculative,
            )
            self._engine = Engine(self, config)
        return self._engine

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
    ) -> RequestOutput:
        ids = self.tokenizer.encode_chat(messages)
        return self.stream(ids, sampling_params or SamplingParams()).run()

    def chat_session(
        self, params: SamplingParams, system: str | None = None, use_template: bool = True
    ) -> ChatSession:
        """A multi-turn conversation that prefills only each turn's new tokens.

        It owns its cache: requests on this LLM in between cannot touch the conversation.
        With `speculative` set, every turn decodes speculatively on that cache (its drafts
        checked as rows of one step, in the weights' batch layout, so greedy turns are the
        plain turns' tokens).
        """
        engine = self.cache_engine(self.new_cache(), reuse=True)
        return ChatSession(engine, params, system, self.config.vocab_size, use_template)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "kv_mode": self.kv_mode,
            "dtype": dtype_name(self.dtype),
            "weights": self.weights or dtype_name(self.dtype),
            "kernels": kernels.status() if self.weights in defaults.LOW_BIT else None,
            "prefill_dtype": self.prefill_dtype,
            "attention_bf16_from": self.numerics.attention_bf16_from,
            "activations": self.activations,
            "numerics": list(self.numerics.reasons),
            "kv_dtype": self.cache_spec().kv_name,
            "max_context": self.max_context,
            "rope_scaling": _rope_described(self.config.rope_scaling),
            "device": str(self.device),
            "decode_step": self.runner.decode_step(self.cache),
        }


def _rope_described(s) -> str:
    """A RoPE scaling as describe() shows it: "none", or its kind, factor and length."""
    if s.rope_type == "default":
        return "none"
    return f"{s.rope_type}, factor {s.factor:g} over {s.original_max_position_embeddings} tokens"


def _check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise InvalidRequestError(f"unknown device {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device 'cuda' requested but no CUDA GPU is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidRequestError(
            f"device {device!r} requested but this machine has {torch.cuda.device_count()} "
            "CUDA GPU(s)"
        )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidRequestError("device 'mps' requested but MPS is not available")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise InvalidRequestError(f"unsupported device {device!r} (cpu, cuda, mps)")
    return dev


def _cpu_experts(value: int | str, config, device: torch.device, dtype: torch.dtype) -> int:
    """How many expert layers keep their routed experts in host memory (--cpu-experts N:
    the first N; "all", or N past the count: every one; 0: none), or one clear error."""
    layers = len(config.expert_layers)
    if value == "all":
        return layers
    try:
        n = operator.index(int(value) if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"--cpu-experts takes a count of layers or 'all', not "
                                  f"{value!r}", param="cpu_experts") from None  # fmt: skip
    if n < 0:
        raise InvalidRequestError(f"--cpu-experts {n}: a count of layers is >= 0",
                                  param="cpu_experts")  # fmt: skip
    if n and not layers:
        raise InvalidRequestError("--cpu-experts: this model has no mixture-of-experts layers",
                                  param="cpu_experts")  # fmt: skip
    if n and device.type == "cpu" and dtype == torch.float32:
        raise InvalidRequestError(
            "--cpu-experts keeps experts in host memory beside a GPU (or a model in another "
            "dtype); on the CPU in fp32 every expert is already there",
            param="cpu_experts",
        )
    return min(n, layers)


def _speculative_config(
    speculative: SpeculativeConfig | str | None, kv: str
) -> SpeculativeConfig | None:
    if isinstance(speculative, str):
        try:
            speculative = SpeculativeConfig(method=speculative)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="speculative") from None
    if speculative is not None and kv in NO_SPECULATION:
        raise InvalidRequestError(
            f"no speculative decoding with kv {kv!r}: {NO_SPECULATION[kv]}",
            param="speculative",
        )
    return speculative


PROMPTS_ARE = "prompts are a string or a list of strings (token ids: prompt_token_ids=)"


def _listed(value: object, what: str) -> list:
    """`value` as a list, or one clear error naming `what` it should be (a user's
    `generate(5)`, a str of ids, a flat list of ids)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"{what}, not {type(value).__name__} {value!r:.40}")
    return list(value)


def _token_ids(ids: object) -> list[int]:
    """One prompt's token ids (ints; a bool is not one), or one clear error."""
    out = []
    for i in _listed(ids, "prompt_token_ids is a list of lists of ints"):
        try:
            if isinstance(i, bool):
                raise TypeError
            out.append(operator.index(i))  # an int, a numpy int, a 0-d integer tensor
        except TypeError:
            raise InvalidRequestError(
                f"prompt_token_ids holds lists of ints: {i!r:.40} is a {type(i).__name__}"
            ) from None
    return out


def _check_settings(
    kv: str, threads: int | None, prefill_chunk: int | None, weights: str | None,
    kv_dtype: str | torch.dtype | None,
) -> None:  # fmt: skip
    """The LLM's settings a typo can spoil, refused before the slow load."""
    if threads is not None and threads < 1:
        raise InvalidRequestError("threads must be >= 1")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise InvalidRequestError("prefill_chunk must be >= 1")
    check_mode(kv)
    if weights not in (*WEIGHT_FORMATS, defaults.AUTO):
        valid = ", ".join(f for f in (defaults.AUTO, *WEIGHT_FORMATS) if f)
        raise InvalidRequestError(f"unknown weight format {weights!r}; valid: {valid}")
    if kv_dtype is not None and kv_dtype != defaults.AUTO:
        sides = kv_sides(kv_dtype) if isinstance(kv_dtype, str) else (kv_dtype,)
        for side in sides:
            if side != defaults.AUTO:
                parse_kv_dtype(side)


def _weight_format(numerics: defaults.Numerics, dtype: torch.dtype, device: torch.device):
    """The packed weight format the model is built with (None: the file's floats at
    `dtype`), the resolved numerics checked against each other and the device."""
    weights = numerics.weights
    if weights == "f32":
        if dtype != torch.float32:
            raise InvalidRequestError("--weights f32 needs --dtype fp32")
        weights = None
    if weights is not None and device.type != "cpu":
        raise InvalidRequestError(
            f"--weights {weights} runs on the CPU kernels only; on {device.type} use "
            "--dtype bf16 or fp16"
        )
    for name, valid in RESOLVED.items():
        value, flag = getattr(numerics, name), name.replace("_", "-")
        if value not in valid:
            what = name.replace("_", " ")
            raise InvalidRequestError(f"unknown {what} {value!r}; valid: {', '.join(valid)}")
        if value != "fp32" and weights not in defaults.LOW_BIT:
            raise InvalidRequestError(f"--{flag} {value} applies to --weights int8|int4|native")
    return weights
