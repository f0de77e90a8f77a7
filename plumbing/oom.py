"""The OOM reaction (the `max_oom_retries` key): a phase that runs out of device memory on any rank
is redone on every rank with micro-batches 20% smaller, from the same rollouts.

    oom = OomReaction(accelerator, base_sizes(cfg), cfg.max_oom_retries)
    result = oom.retry("actor", work, drop)            # work() until a try passes, e.g. one mini-batch
    # inside work():
    micro, max_tokens = oom.size("actor")              # what the phase cuts its micro-batches by
    with oom.agreed("actor"):                          # one pass: a micro-batch's forward and loss
        ...
    with oom.agreed("actor"):                          # the next pass: its backward
        ...

Every rank must meet where the OOM is agreed on: `agreed` catches an out-of-memory error in its
block (torch.OutOfMemoryError on a GPU; on a CPU torch's allocator raises a RuntimeError instead),
then all ranks sum a flag (a collective every rank reaches, after the block) and, if any rank
failed, all raise PhaseOOM together; `retry` then drops the partial work (`drop`, e.g.
zeroing accumulated gradients), shrinks the phase's sizes, empties the caches and runs the unit
again. A block holds one pass that runs collectives (one forward, or one backward): an OOM in a
first pass must be agreed on before any rank enters the second pass's collectives. Under ZeRO-3
a block must hold no collective after the point where an OOM can strike on one rank only
(docs/checkpoints.md, "OOM reaction": a forward's parameter gathers come before the LM head's
allocations, where an OOM usually strikes; a backward or optimizer step that fails mid-way leaves
the other ranks waiting in a collective, which nothing on this side can end).
Sizes live here (run state, checkpointed), never in the config.
"""
from __future__ import annotations

import gc
import sys
from contextlib import contextmanager

import torch

from errors import UserError

SHRINK = 0.8   # 20% smaller per OOM: the practice is to keep the OOM rate under 1%, not to find the edge
# phase -> (its micro-batch size key, its token budget key): what the stop message advises changing
PHASE_KEYS = {"log_prob": ("log_prob_micro_batch_size_per_device", "log_prob_max_token_len_per_device"),
              "actor": ("ppo_micro_batch_size_per_device", "ppo_max_token_len_per_device"),
              "critic": ("critic_ppo_micro_batch_size_per_device", "critic_ppo_max_token_len_per_device")}


def is_oom(error: BaseException) -> bool:
    """Out of memory: torch.OutOfMemoryError (CUDA), or the RuntimeError torch's CPU allocator
    raises when the host cannot give it the memory (no OutOfMemoryError exists for that case)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))


class PhaseOOM(Exception):
    """Raised on every rank together when any rank ran out of memory in `phase`."""

    def __init__(self, phase: str):
        super().__init__(f"out of memory in phase {phase}")
        self.phase = phase


def base_sizes(cfg) -> dict[str, list[int]]:
    """phase -> [sequences per micro-batch, token budget (0 = by sequence count)] as configured
    (train_ppo's Config)."""
    from config import schedule
    actor, critic, log_prob = schedule(cfg, "actor"), schedule(cfg, "critic"), schedule(cfg, "log_prob")
    return {"log_prob": [log_prob.micro_batch, log_prob.max_tokens],
            "actor": [actor.micro_batch, actor.max_tokens], "critic": [critic.micro_batch, critic.max_tokens]}


class OomReaction:
    def __init__(self, accelerator, sizes: dict[str, list[int]], max_retries: int):
        self.accelerator, self.max_retries = accelerator, max_retries
        self.configured = {p: list(s) for p, s in sizes.items()}
        self.sizes = {p: list(s) for p, s in sizes.items()}   # in use; checkpointed
        self.in_a_row = 0      # OOMs since the last unit of work that passed
        self.step_count = 0    # OOMs in the current step: guard/oom
        self.step = 0

    def size(self, phase: str) -> tuple[int, int]:
        micro, max_tokens = self.sizes[phase]
        return micro, max_tokens

    def scaled(self, phase: str, micro: int, max_tokens: int) -> tuple[int, int]:
        """Other sizes of the phase (e.g. the critic's no-grad pass in log_prob) shrunk alike."""
        (m0, t0), (m, t) = self.configured[phase], self.sizes[phase]
        return max(1, micro * m // m0), (max(1, max_tokens * t // t0) if max_tokens and t0 else max_tokens)

    def start_step(self, step: int) -> None:
        self.step, self.step_count = step, 0

    @contextmanager
    def agreed(self, phase: str):
        """Catch an OOM in the block; then every rank agrees (a collective after the block) and
        raises PhaseOOM together if any rank failed. Off (max_oom_retries=0): the OOM is raised."""
        failed = False
        try:
            yield
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if self.max_retries <= 0 or not is_oom(error):
                raise
            failed = True
        if self.max_retries > 0 and self._any(failed):
            raise PhaseOOM(phase)

    def _any(self, failed: bool) -> bool:
        if self.accelerator.num_processes == 1:
            return failed
        flag = torch.tensor([float(failed)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)

    def retry(self, phase: str, work, drop=lambda: None):
        """work() until a try passes -> its result. A try that ends in PhaseOOM has its partial
        work dropped (drop()), the phase's sizes shrunk and the caches emptied before the next;
        after max_oom_retries OOMs in a row the run stops (UserError, one line naming the phase
        and the keys)."""
        while True:
            try:
                result = work()
            except PhaseOOM:
                drop()
                self._react(phase)
                continue
            self.in_a_row = 0
            return result

    def _react(self, phase: str) -> None:
        self.in_a_row += 1
        self.step_count += 1
        micro, max_tokens = self.sizes[phase]
        shrunk = [max(1, min(micro - 1, int(micro * SHRINK))), max(1, min(max_tokens - 1, int(max_tokens * SHRINK)))
                  if max_tokens else 0]
        size_key, token_key = PHASE_KEYS[phase]
        unit = f"token budget {max_tokens}" if max_tokens else f"micro-batch size {micro}"
        if self.in_a_row > self.max_retries or [micro, max_tokens] == shrunk or (not max_tokens and micro == 1):
            key = token_key if max_tokens else size_key
            raise UserError(f"step {self.step}: out of memory in phase {phase} {self.in_a_row} time(s) in a row, down "
                            f"to {unit} (max_oom_retries={self.max_retries}): lower {key} (or set "
                            f"gradient_checkpointing, a ZeRO-3 offload config, shorter max_response_length) and "
                            f"resume with the same command and that change")
        if max_tokens:
            self.sizes[phase][1] = shrunk[1]
        else:
            self.sizes[phase][0] = shrunk[0]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.accelerator.is_main_process:
            new = f"token budget {self.sizes[phase][1]}" if max_tokens else f"micro-batch size {self.sizes[phase][0]}"
            print(f"warning: step {self.step}: out of memory in phase {phase} (on some rank): redone from the same "
                  f"rollouts with {new} (was {unit}; OOM {self.in_a_row}/{self.max_retries} in a row)",
                  file=sys.stderr, flush=True)

    def metrics(self) -> dict:
        """guard/oom (OOMs this step) and each phase's sizes in use: the same keys on every rank."""
        out = {"guard/oom": float(self.step_count)}
        for phase, (micro, max_tokens) in self.sizes.items():
            out[f"guard/oom_micro_batch_size/{phase}"] = float(micro)
            if max_tokens:
                out[f"guard/oom_max_token_len/{phase}"] = float(max_tokens)
        return out

    def state_dict(self) -> dict:
        return {"configured": self.configured, "sizes": self.sizes}

    def load_state_dict(self, state: dict | None) -> None:
        """The shrunk sizes, unless the configured ones changed since (e.g. the stop's advice was
        followed): then the new configuration is taken as it is."""
        if state and state.get("configured") == self.configured:
            self.sizes = {p: list(s) for p, s in state["sizes"].items()}
