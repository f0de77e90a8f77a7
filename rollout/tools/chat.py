"""The conversation at the token level, through the tokenizer's own chat template.

Tool observations are tokenized once, as the template renders them after the assistant turn:
the tokens are the difference between the rendering with the tool message(s) and generation prompt
and the rendering without them. That only means something when the shorter rendering is a token
prefix of the longer one, which `check_template` verifies at startup on a probe conversation and
`observation_ids` verifies again on every real one.
"""
from __future__ import annotations

from errors import UserError

WORKING_TEMPLATES = ("ChatML with tool messages as Qwen2.5 renders them (<tool_call>/<tool_response>), Llama 3.1 "
                     "Instruct's, or any template that renders earlier turns the same whatever follows them")

# The probe carries a reasoning block: templates that drop <think>...</think> from earlier assistant
# turns (the DeepSeek-R1 / QwQ habit) change the past once a tool turn follows, and are refused.
_PROBE_USER = {"role": "user", "content": "What is 6*7?"}
_PROBE_CALL = ('<think>\nI should use the calculator.\n</think>\n\n<tool_call>\n'
               '{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>')
_PROBE_ANSWER = "6*7 = 42."


class ChatFormat:
    def __init__(self, tokenizer, tools: list[dict] | None = None, stop_ids: set[int] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None                         # OpenAI-format schemas (ToolSet.schemas)
        self.stop_ids = set(stop_ids) if stop_ids else {tokenizer.eos_token_id}   # ids that end a turn

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=True, return_dict=False,
                                                       add_generation_prompt=add_generation_prompt))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.render(messages, add_generation_prompt=True)

    def assistant_text(self, ids: list[int]) -> str:
        """One generated turn as text, its closing stop token left out (the template adds its own)."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def observation_ids(self, messages: list[dict], observations: list[str]) -> list[int]:
        """The tokens that follow an assistant turn ending in a stop token: the rest of the template's
        end of that turn (e.g. ChatML's newline after <|im_end|>), the tool message(s), and the
        generation prompt of the next assistant turn. `messages` ends with that assistant turn."""
        before = self.render(messages, add_generation_prompt=False)
        after = self.render(messages + [{"role": "tool", "content": o} for o in observations],
                            add_generation_prompt=True)
        _require_prefix(before, after, "appending a tool message")
        stops = [i for i, t in enumerate(before) if t in self.stop_ids]
        if not stops:
            raise UserError(f"chat template: no stop token {sorted(self.stop_ids)} ends the assistant turn; "
                            "set the stop ids to the template's end-of-turn token")
        return before[stops[-1] + 1:] + after[len(before):]


def check_template(chat: ChatFormat) -> None:
    """Refuse (one line) a template under which appending a tool turn changes the tokens before it."""
    conv = [_PROBE_USER]
    steps = [("the generation prompt", conv, True),
             ("an assistant turn", conv + [{"role": "assistant", "content": _PROBE_CALL}], False),
             ("a tool message", conv + [{"role": "assistant", "content": _PROBE_CALL},
                                        {"role": "tool", "content": "42"}], True),
             ("the next assistant turn", conv + [{"role": "assistant", "content": _PROBE_CALL},
                                                 {"role": "tool", "content": "42"},
                                                 {"role": "assistant", "content": _PROBE_ANSWER}], False)]
    try:
        renders = [(what, chat.render(messages, gen)) for what, messages, gen in steps]
    except Exception as e:   # jinja errors: e.g. a template that raises on the "tool" role
        raise UserError(f"chat template cannot render a tool conversation ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); templates that work: {WORKING_TEMPLATES}") from None
    for (_, shorter), (what, longer) in zip(renders, renders[1:]):
        _require_prefix(shorter, longer, f"appending {what}")
    tool_part = chat.tokenizer.decode(renders[2][1][len(renders[1][1]):])
    if "42" not in tool_part:
        raise UserError("chat template drops tool messages (the tool output is not in its rendering); "
                        f"templates that work: {WORKING_TEMPLATES}")
    chat.observation_ids(steps[1][1], ["42"])   # the assistant turn ends with a stop token


def _require_prefix(shorter: list[int], longer: list[int], what: str) -> None:
    if longer[:len(shorter)] != shorter:
        at = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), min(len(shorter), len(longer)))
        raise UserError(f"chat template is not prefix-preserving: {what} changes the tokens before it "
                        f"(first difference at token {at}), so tool turns cannot be appended token by token; "
                        f"templates that work: {WORKING_TEMPLATES}")
