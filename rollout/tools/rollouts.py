"""Multi-turn rollouts as the training loop sees them (config keys tools / environment): phase 1
calls `ToolRollouts.generate` instead of `engine.generate` and gets the same fields back, plus the
prompt ids (the chat template with the tool schemas), the tool mask and what the reward function
may read.

    tools = make_tool_rollouts(cfg, tokenizer)          # None when neither key is set; checks the template
    out = tools.generate(engine, prompts, params, any_active)
    batch = out.batch(pad_id)                           # response_mask x tool mask: tool tokens get no loss
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from config import Config
from errors import UserError
from forward.batch import pack_batch
from prompts.sets import PromptSet
from rollout import RolloutEngine, SamplingParams, Share
from rollout.tools.builtin import PythonLimits, make_python_tool, python
from rollout.tools.chat import ChatFormat, check_template
from rollout.tools.loop import ToolEnvironment, Trajectory, run_multiturn, tool_metrics
from rollout.tools.sandbox import check_sandbox
from rollout.tools.spec import load_environment, load_tool
from rollout.tools.toolset import ToolSet

# what a reward function may take after (prompts, responses), besides dataset columns
TRAJECTORY_COLUMNS = ("messages", "tool_calls", "tool_errors", "env_reward")


@dataclass
class ToolRolloutOutput:
    """RolloutOutput's fields (responses, logprobs) and what multi-turn adds, one entry per trajectory."""
    prompt_ids: list[list[int]]
    responses: list[list[int]]               # everything after the prompt: model and tool tokens
    logprobs: list[list[float]] | None       # the sampler's, 0.0 at tool tokens; None when greedy (hf)
    tool_mask: torch.Tensor                  # [b, R] 1 at model tokens, 0 at tool/template tokens and padding
    truncated: torch.Tensor                  # [b] bool: cut at max_response_length
    columns: dict[str, list]                 # TRAJECTORY_COLUMNS, for the reward function
    trajectories: list[Trajectory] = field(repr=False, default_factory=list)
    tools_s: float = 0.0                     # wall time waiting on tool calls

    def batch(self, pad_id: int) -> dict:
        """pack_batch's tensors, with the tool mask multiplied into response_mask: tool tokens take no
        part in the policy loss, KL, entropy, value loss or advantages (they are context only)."""
        batch = pack_batch(self.prompt_ids, self.responses, pad_id)
        batch["response_mask"] = batch["response_mask"] * self.tool_mask                # [b, R]
        return batch

    @staticmethod
    def concat(parts: list["ToolRolloutOutput"]) -> "ToolRolloutOutput":
        """The outputs of consecutive parts of one batch (the shares of a sequence-parallel group), as
        one in their order; time/tools_s is the longest part's (they ran side by side)."""
        R = max(part.tool_mask.shape[1] for part in parts)
        logprobs = None if any(p.logprobs is None for p in parts) else [lp for p in parts for lp in p.logprobs]
        return ToolRolloutOutput([i for p in parts for i in p.prompt_ids], [r for p in parts for r in p.responses],
                                 logprobs, torch.cat([torch.nn.functional.pad(p.tool_mask, (0, R - p.tool_mask.shape[1]))
                                                      for p in parts]),
                                 torch.cat([p.truncated for p in parts]),
                                 {k: [v for p in parts for v in p.columns[k]] for k in parts[0].columns},
                                 [t for p in parts for t in p.trajectories], max(p.tools_s for p in parts))

    def bonus(self, per_trajectory: float) -> torch.Tensor:
        """tool_call_bonus on each trajectory with at least one tool call that did not fail -> [b]."""
        return torch.tensor([per_trajectory * (t.tool_calls > t.tool_errors) for t in self.trajectories])

    def metrics(self) -> dict[str, float]:
        """This rank's tools/* figures and time/tools_s (the same keys on every rank, every step)."""
        out = tool_metrics(self.trajectories)
        out.pop("tools/tool_s_mean")
        out["time/tools_s"] = self.tools_s
        return out


class ToolRollouts:
    def __init__(self, cfg: Config, tokenizer):
        self.cfg = cfg
        self.env_class = load_environment(cfg.environment) if cfg.environment else None
        functions = [] if self.env_class else _tool_functions(cfg)
        self.toolset = None if self.env_class else ToolSet(functions, timeout_s=cfg.tool_timeout_s)
        # the python tool's sandbox, checked at startup ("bwrap" or "none"); None without that tool
        self.sandbox = next((fn.sandbox for fn in functions if hasattr(fn, "sandbox")), None)
        self.chat = ChatFormat(tokenizer, self.toolset.schemas if self.toolset else None,
                               template_kwargs=cfg.chat_template_kwargs)
        check_template(self.chat)

    @property
    def names(self) -> list[str]:
        """What the policy may call, for messages: the tool names, or the environment class."""
        if self.toolset is None:
            return [f"environment {self.cfg.environment}"]
        return [schema["function"]["name"] for schema in self.toolset.schemas]

    def prompt_ids(self, row: dict, text: str) -> list[int]:
        """A data row's prompt as the policy sees it, rendered with the tool schemas (--dry_run's length
        check; an environment's reset may still replace the messages)."""
        return self.chat.prompt_ids(_messages(row.get(self.cfg.prompt_key, text)))

    def sandbox_notes(self) -> tuple[dict, list[str]]:
        """The MLflow tag and the startup warning that say how the python tool's code runs."""
        if self.sandbox is None:
            return {}, []
        warning = ["tool_sandbox=none: the python tool runs the policy's code as a plain subprocess with only "
                   "rlimits; it can read and write your files, reach the network and signal this process"]
        return {"tool_sandbox": self.sandbox}, warning if self.sandbox == "none" else []

    def environments(self, n: int) -> list:
        if self.env_class is None:
            return [ToolEnvironment(self.toolset) for _ in range(n)]
        try:
            return [self.env_class() for _ in range(n)]
        except TypeError as e:
            raise UserError(f"environment {self.cfg.environment!r}: {self.env_class.__name__}() must take no "
                            f"arguments ({e})") from None

    def generate(self, engine: RolloutEngine, prompts: PromptSet, params: SamplingParams,
                 any_active=None, share: Share | None = None) -> ToolRolloutOutput:
        """One trajectory per row of `prompts` (already repeated rollout_n times, prompt-major).
        share: these rows' places in a batch other ranks run the rest of (run_multiturn)."""
        cfg, clock = self.cfg, {}
        rows = prompts.rows or [{} for _ in prompts.ids]
        messages = [_messages(row.get(cfg.prompt_key, text)) for row, text in zip(rows, prompts.texts)]
        trajectories = run_multiturn(engine, self.chat, messages, self.environments(len(messages)), params,
                                     cfg.max_response_length, cfg.max_turns,
                                     rows=[{**row, "messages": m} for row, m in zip(rows, messages)],
                                     tool_workers=cfg.tool_workers, overlap=cfg.tool_overlap,
                                     any_active=any_active, clock=clock, share=share)
        longest = max((len(t.prompt_ids) for t in trajectories), default=0)
        if longest > cfg.max_prompt_length:
            raise UserError(f"a prompt rendered with the tool schemas is {longest} tokens > max_prompt_length="
                            f"{cfg.max_prompt_length}: raise max_prompt_length (it counts the tools' descriptions)")
        R = max(1, max((len(t.mask) for t in trajectories), default=0))
        tool_mask = torch.zeros(len(trajectories), R)                                  # [b, R]
        for i, t in enumerate(trajectories):
            tool_mask[i, :len(t.mask)] = torch.tensor(t.mask, dtype=tool_mask.dtype)
        logprobs = None if any(t.logprobs is None for t in trajectories) else [t.logprobs for t in trajectories]
        columns = {"messages": [t.messages for t in trajectories], "tool_calls": [t.tool_calls for t in trajectories],
                   "tool_errors": [t.tool_errors for t in trajectories],
                   "env_reward": [t.env_reward for t in trajectories]}
        return ToolRolloutOutput([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                                 logprobs, tool_mask, torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
                                 columns, trajectories, clock.get("tools_s", 0.0))


def make_tool_rollouts(cfg: Config, tokenizer) -> ToolRollouts | None:
    return ToolRollouts(cfg, tokenizer) if cfg.tools or cfg.environment else None


def _tool_functions(cfg: Config) -> list:
    functions = []
    for spec in [s.strip() for s in cfg.tools.split(",") if s.strip()]:
        fn, _ = load_tool(spec)
        if fn is python:   # the built-in executor, under tool_timeout_s, in tool_sandbox (once: it can start)
            check_sandbox(cfg.tool_sandbox)
            fn = make_python_tool(PythonLimits(timeout_s=cfg.tool_timeout_s), cfg.tool_sandbox)
        functions.append(fn)
    return functions


def _messages(prompt) -> list[dict]:
    """A row's prompt as chat messages: a list of them as is, a plain string as one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]
