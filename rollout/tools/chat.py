"""The conversation at the token level, through the tokenizer's own chat template.

Tool observations are tokenized once, as the template renders them after the assistant turn:
the tokens are the difference between the rendering with the tool message(s) and generation prompt
and the rendering without them. That only means something when the shorter rendering is a token
prefix of the longer one, and the trajectory is only what the model would see at inference when
its context is the template's rendering of the conversation so far. `check_template` verifies both
at startup on a probe conversation; `observation_ids` verifies both again before every assistant
turn after the first of every real trajectory, against the rendering it makes anyway.
"""
from __future__ import annotations

from pathlib import Path

from errors import UserError

WORKING_TEMPLATES = ("ChatML with tool messages as Qwen2.5 renders them (<tool_call>/<tool_response>), Llama 3.1 "
                     "Instruct's, or any template that renders earlier turns the same whatever follows them")

# The probe: a system message, reasoning blocks (an empty one too), two calls in one turn, a failed call
# and three assistant turns. Templates that drop <think>...</think> from assistant turns (the DeepSeek-R1
# / QwQ habit), that add to the generation prompt what the next rendering lacks (e.g. a nudge after an
# error) or that move the system prompt as turns follow, are refused.
_PROBE_SYSTEM = {"role": "system", "content": "You are a careful assistant."}
_PROBE_USER = {"role": "user", "content": "What are 6*7 and 2**10, and is 1/0 defined?"}
_PROBE_TURNS = [   # (assistant turn, the tool messages that follow it)
    (('<think>\nI should use the calculator.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
      '{"expression": "6*7"}}\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": '
      '{"expression": "1/0"}}\n</tool_call>'), ["42", "error: calculator: division by zero"]),
    ('<think>\n\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2**10"}}\n</tool_call>',
     ["1024"]),
    ("<think>\nBoth are known now.\n</think>\n\n6*7 = 42, 2**10 = 1024, and 1/0 is undefined.", []),
]


class ChatFormat:
    def __init__(self, tokenizer, tools: list[dict] | None = None, stop_ids: set[int] | None = None,
                 template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None                         # OpenAI-format schemas (ToolSet.schemas)
        self.stop_ids = set(stop_ids) if stop_ids else {tokenizer.eos_token_id}   # ids that end a turn
        self.template_kwargs = dict(template_kwargs or {})   # chat_template_kwargs, e.g. enable_thinking
        self.name = template_name(tokenizer)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=True, return_dict=False,
                                                       add_generation_prompt=add_generation_prompt,
                                                       **self.template_kwargs))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.render(messages, add_generation_prompt=True)

    def assistant_text(self, ids: list[int]) -> str:
        """One generated turn as text, its closing stop token left out (the template adds its own)."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def observation_ids(self, messages: list[dict], observations: list[str], context: list[int] | None = None,
                        turn: int = 0) -> list[int]:
        """The tokens that follow an assistant turn ending in a stop token: the rest of the template's
        end of that turn (e.g. ChatML's newline after <|im_end|>), the tool message(s), and the
        generation prompt of the next assistant turn. `messages` ends with that assistant turn.
        context: the trajectory's ids so far (prompt + response, that turn's stop token last); given,
        context + observation must be the template's rendering of the conversation with the tool
        messages, which is what assistant turn `turn` is generated from; else a one-line UserError."""
        before = self.render(messages, add_generation_prompt=False)
        after = self.render(messages + [{"role": "tool", "content": o} for o in observations],
                            add_generation_prompt=True)
        self.require_prefix(before, after, "appending a tool message")
        stops = [i for i, t in enumerate(before) if t in self.stop_ids]
        if not stops:
            raise UserError(f"chat template: no stop token {sorted(self.stop_ids)} ends the assistant turn; "
                            "set the stop ids to the template's end-of-turn token")
        observation = before[stops[-1] + 1:] + after[len(before):]
        if context is not None and context + observation != after:
            raise UserError(self.mismatch(context + observation, after, f"before assistant turn {turn}"))
        return observation

    def mismatch(self, trajectory: list[int], rendering: list[int], where: str) -> str:
        """The one line that names the template, the turn and the first token where the trajectory
        differs from the template's rendering of the same conversation."""
        at, ours, theirs = self.first_difference(trajectory, rendering)
        return (f"chat template {self.name}: {where}, the trajectory differs from the template's rendering of the "
                f"conversation so far at token {at}: the trajectory has {ours}, the template renders {theirs} (a "
                f"template that rewrites earlier turns, e.g. strips reasoning, or text that tokenizes differently "
                f"once decoded), so training would use a context the model never sees at inference; templates that "
                f"work: {WORKING_TEMPLATES}")

    def require_prefix(self, shorter: list[int], longer: list[int], what: str) -> None:
        if longer[:len(shorter)] != shorter:
            at, was, becomes = self.first_difference(shorter, longer)
            raise UserError(f"chat template {self.name} is not prefix-preserving: {what} changes the tokens before "
                            f"it (token {at}: {was} becomes {becomes}), so tool turns cannot be appended token by "
                            f"token; templates that work: {WORKING_TEMPLATES}")

    def first_difference(self, a: list[int], b: list[int]) -> tuple[int, str, str]:
        """The first position where two id lists differ, and each one's token there, decoded."""
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return at, self._token(a, at), self._token(b, at)

    def _token(self, ids: list[int], at: int) -> str:
        if at >= len(ids):
            return "nothing (it ends)"
        if ids[at] >= len(self.tokenizer):   # a model's spare embedding rows: sampled, but no text to render
            return f"id {ids[at]}, which the tokenizer cannot decode (it has {len(self.tokenizer)} tokens)"
        return f"{self.tokenizer.decode(ids[at:at + 1])!r}"


def template_name(tokenizer) -> str:
    """How errors name the chat template: its file when the tokenizer was loaded from a directory
    holding one, else the tokenizer's name_or_path."""
    where = getattr(tokenizer, "name_or_path", "") or ""
    if where and (Path(where) / "chat_template.jinja").is_file():
        return str(Path(where) / "chat_template.jinja")
    return f"of {where}" if where else "(the tokenizer's, which has no name_or_path)"


def check_template(chat: ChatFormat) -> None:
    """Refuse (one line) a template under which appending a turn changes the tokens before it, or under
    which a trajectory built token by token on the probe conversation is not the template's rendering."""
    try:
        _probe_renderings(chat)
        _probe_trajectory(chat)
    except UserError as e:
        raise UserError(f"startup probe: {e}") from None


def _probe_renderings(chat: ChatFormat) -> None:
    """Each rendering of the probe, turn by turn, is a token prefix of the next; tool messages show."""
    messages, renders = [_PROBE_SYSTEM, _PROBE_USER], []
    try:
        renders.append(("the generation prompt", chat.render(messages, True)))
        for turn, (reply, tool_texts) in enumerate(_PROBE_TURNS, start=1):
            messages = messages + [{"role": "assistant", "content": reply}]
            renders.append((f"assistant turn {turn}", chat.render(messages, False)))
            if tool_texts:
                messages = messages + [{"role": "tool", "content": t} for t in tool_texts]
                renders.append((f"the tool messages after turn {turn}", chat.render(messages, True)))
    except Exception as e:   # jinja errors: e.g. a template that raises on the "tool" role
        raise UserError(f"chat template {chat.name} cannot render a tool conversation ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); templates that work: {WORKING_TEMPLATES}") from None
    for (_, shorter), (what, longer) in zip(renders, renders[1:]):
        chat.require_prefix(shorter, longer, f"appending {what}")
    tool_part = chat.tokenizer.decode(renders[2][1][len(renders[1][1]):])
    if "42" not in tool_part:
        raise UserError(f"chat template {chat.name} drops tool messages (the tool output is not in its rendering); "
                        f"templates that work: {WORKING_TEMPLATES}")


def _probe_trajectory(chat: ChatFormat) -> None:
    """The probe as run_multiturn builds it: each assistant turn's tokens (its text tokenized, as a model
    trained on the template would generate it, and a stop token), then observation_ids, which checks
    the trajectory against the template's rendering before every turn after the first."""
    stop = chat.tokenizer.eos_token_id if chat.tokenizer.eos_token_id in chat.stop_ids else min(chat.stop_ids)
    messages = [_PROBE_SYSTEM, _PROBE_USER]
    context = chat.prompt_ids(messages)
    for turn, (reply, tool_texts) in enumerate(_PROBE_TURNS, start=1):
        context = context + chat.tokenizer(reply, add_special_tokens=False)["input_ids"] + [stop]
        messages = messages + [{"role": "assistant", "content": reply}]
        if not tool_texts:
            break
        context = context + chat.observation_ids(messages, tool_texts, context, turn + 1)
        messages = messages + [{"role": "tool", "content": t} for t in tool_texts]
