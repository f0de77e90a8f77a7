"""Multi-turn tool use (rollout/tools): tool loading and schemas, the built-in calculator and Python
executor, <tool_call> parsing, the chat template at the token level, and the multi-turn loop.

Offline: the tokenizer is a byte-level BPE built here with Qwen2.5's chat template written out in
tests/data/chat_templates. The loop runs through the real hf engine on a tiny Qwen2 that memorised
a few tool-use conversations (slow), and through ScriptedEngine, an implementation of the rollout
protocol defined here that replays fixed replies, for the paths a memorised model cannot be made
to walk cheaply (budgets cut mid-observation, malformed calls, filler passes).
"""
import functools
import itertools
import math
import sys
import threading
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from errors import UserError
from rollout import RolloutOutput, SamplingParams
from rollout.tools import (ChatFormat, MalformedCall, PythonLimits, ToolCall, ToolEnvironment, ToolError,
                           ToolSet, calculator, check_template, load_environment, load_tool, parse_tool_calls,
                           run_multiturn, run_python, tool_metrics)
from rollout.tools.builtin import calculator as builtin_calculator

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CALC = "rollout.tools.builtin:calculator"
HERE = "tests.test_tools" if "tests.test_tools" in sys.modules else __name__


# --- tools and environments of this module, loaded by spec -----------------------------------------

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def explode(x: str) -> str:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("kaboom")


def garbage(x: str) -> str:
    """Returns something that is not text.

    Args:
        x: Ignored.
    """
    return object()


def hang(x: str) -> str:
    """Sleeps far past any timeout.

    Args:
        x: Ignored.
    """
    import time
    time.sleep(30)
    return "late"


def undocumented(x: str) -> str:
    return x


def untyped(x):
    """No type hints.

    Args:
        x: Anything.
    """
    return x


NOT_CALLABLE = 3


class CountdownEnv:
    """Ends after three assistant turns; reward 1 per turn; observation says how many are left."""
    def reset(self, prompt_row):
        self.left = 3
        return [{"role": "user", "content": f"count from {prompt_row['start']}"}]

    def step(self, text):
        self.left -= 1
        return f"{self.left} left", 1.0, self.left == 0


class NoStep:
    def reset(self, prompt_row):
        return None


# --- a tokenizer with Qwen2.5's chat template, built offline -----------------------------------------

def _byte_level():
    """Byte-level BPE without merges: one token per byte."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def llama3_style_tokenizer():
    """Byte-level plus Llama 3.1 Instruct's special tokens (EOS = <|eot_id|>, its end of turn) and chat
    template, as Meta's tokenizer_config.json has it: tools in the first user message, tool results as
    "ipython" turns."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_byte_level(), bos_token="<|begin_of_text|>",
                                        eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                                "<|eom_id|>", "<|python_tag|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = (TEMPLATES / "llama3_1.jinja").read_text()
    return tokenizer


def qwen_style_tokenizer(template="qwen2_5.jinja"):
    """Byte-level plus Qwen2.5's special tokens."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_byte_level(), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])   # added, not special: decoded into the text
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_style_tokenizer()


@pytest.fixture(scope="module")
def calc_tools():
    return ToolSet.from_specs([CALC, f"{HERE}:explode"])


def call_text(name, arguments):
    import json
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# --- loading and schemas ------------------------------------------------------------------------

def test_schema_is_derived_from_hints_and_docstring():
    fn, schema = load_tool(f"{HERE}:add")
    assert fn(2, 3) == 5
    f = schema["function"]
    assert schema["type"] == "function" and f["name"] == "add" and f["description"] == "Add two integers."
    assert f["parameters"]["properties"] == {"a": {"type": "integer", "description": "The first."},
                                             "b": {"type": "integer", "description": "The second."}}
    assert f["parameters"]["required"] == ["a", "b"]
    assert load_tool(CALC)[1]["function"]["parameters"]["required"] == ["expression"]


@pytest.mark.parametrize("spec, words", [
    ("no_colon", "module:name"),
    ("no_such_module_xyz:f", "cannot import"),
    (f"{HERE}:missing", "no attribute"),
    (f"{HERE}:NOT_CALLABLE", "not callable"),
    (f"{HERE}:undocumented", "docstring"),
    (f"{HERE}:untyped", "type hint"),
])
def test_bad_tool_spec_is_one_line_naming_it(spec, words):
    with pytest.raises(UserError) as e:
        load_tool(spec)
    message = str(e.value)
    assert spec in message and words in message and "\n" not in message


def test_environment_loading():
    assert load_environment(f"{HERE}:CountdownEnv") is CountdownEnv
    with pytest.raises(UserError, match="no step method"):
        load_environment(f"{HERE}:NoStep")
    with pytest.raises(UserError, match="not a class"):
        load_environment(f"{HERE}:add")


# --- calculator -----------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, expected", [
    ("6*7", "42"), ("(12+7)*3**2", "171"), ("-2**2", "-4"), ("7/2", "3.5"), ("7//2", "3"), ("-7 % 3", "2"),
    ("1.5e3 + 0.5", "1500.5"), ("2**-1", "0.5"), ("123456789*987654321", "121932631112635269"),
    ("2**4000", str(2**4000)),
])
def test_calculator_exact(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, words", [
    ("1/0", "division by zero"), ("5 % 0", "division by zero"),
    ("2^10", "use **"), ("6*", "not an arithmetic expression"), ("", "not an arithmetic expression"),
    ("9**9**9", "exponent too large"), ("2**100000", "bits"), ("10**1000 * 10**1000 * 10**1000", "bits"),
    ("(10**300)**5", "bits"), ("1e308*10", "finite"), ("(-8)**0.5", "real"),
    ("x+1", "Name"), ("__import__('os').system('echo pwned')", "Call"), ("(1).__class__", "Attribute"),
    ("'a'*3", "Constant"), ("True+1", "Constant"), ("1j*1j", "Constant"), ("lambda: 1", "Lambda"),
    ("[1, 2]", "List"), ("1 if 1 else 2", "IfExp"), ("1 << 10000", "LShift"),
    ("1+" * 600 + "1", "longer than"), ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
])
def test_calculator_refuses(expression, words):
    with pytest.raises(ToolError, match=words.replace("*", r"\*")):
        calculator(expression)


def test_calculator_failure_is_a_counted_observation(calc_tools):
    result = calc_tools.run(ToolCall("calculator", {"expression": "__import__('os')"}))
    assert not result.ok and result.text.startswith("error: calculator: ")


# --- Python executor ----------------------------------------------------------------------------------

def test_python_prints_output():
    assert run_python("import math\nprint(math.factorial(20))\nprint('done')") == "2432902008176640000\ndone\n"


def test_python_exception_is_an_error_with_its_traceback():
    tools = ToolSet.from_specs(["rollout.tools.builtin:python"])
    result = tools.run(ToolCall("python", {"code": "print('before')\nraise ValueError('boom')"}))
    assert not result.ok
    assert result.text.startswith("error: python: exit status 1") and "before" in result.text
    assert "ValueError: boom" in result.text and 'File "main.py", line 2' in result.text


def test_python_wall_timeout_kills_it():
    with pytest.raises(ToolError, match="timed out after 1 s"):
        run_python("import time\nprint('started', flush=True)\ntime.sleep(60)\nprint('never')",
                   PythonLimits(timeout_s=1, cpu_s=5))


def test_python_cpu_limit():
    with pytest.raises(ToolError, match="CPU time limit of 1 s"):
        run_python("while True:\n    pass", PythonLimits(timeout_s=120, cpu_s=1))


def test_python_memory_limit():
    with pytest.raises(ToolError, match="MemoryError"):
        run_python("x = bytearray(2 * 1024**3)\nprint(len(x))", PythonLimits(memory_mb=256))


def test_python_output_is_capped():
    with pytest.raises(ToolError) as e:
        run_python("for i in range(10**7):\n    print(i)", PythonLimits(max_output_bytes=1000))
    message = str(e.value)
    assert message.startswith("output exceeded 1000 bytes and the program was stopped\n0\n1\n")
    assert len(message) < 2 * 1000 + 500
    assert run_python("print('x' * 999, end='')", PythonLimits(max_output_bytes=1000)) == "x" * 999


# --- tool set: validation and failures ----------------------------------------------------------------

def test_toolset_turns_every_failure_into_an_error_observation():
    tools = ToolSet.from_specs([f"{HERE}:add", f"{HERE}:explode", f"{HERE}:garbage", f"{HERE}:hang"], timeout_s=0.3)
    assert tools.run(ToolCall("add", {"a": 2, "b": 3})).text == "5"
    cases = [
        (ToolCall("explode", {"x": ""}), "error: explode: RuntimeError: kaboom"),
        (ToolCall("garbage", {"x": ""}), "error: garbage returned object, not text"),
        (ToolCall("hang", {"x": ""}), "error: hang: timed out after 0.3 s"),
        (ToolCall("nope", {}), "error: unknown tool 'nope'; available: add, explode, garbage, hang"),
        (ToolCall("add", {"a": 1}), "error: add: missing argument(s) b"),
        (ToolCall("add", {"a": 1, "b": 2, "c": 3}), "error: add: unknown argument(s) c; expected: a, b"),
        (ToolCall("add", {"a": "1", "b": 2}), "error: add: argument 'a' must be integer, got str"),
        (ToolCall("add", {"a": True, "b": 2}), "error: add: argument 'a' must be integer, got bool"),
        (MalformedCall("bad JSON", "{"), "error: malformed tool call: bad JSON"),
    ]
    for call, text in cases:
        result = tools.run(call)
        assert (result.ok, result.text) == (False, text)


def test_toolset_refuses_duplicate_names():
    with pytest.raises(UserError, match="two tools are named 'add'"):
        ToolSet([add, add])


# --- parsing ------------------------------------------------------------------------------------------

def test_parse_good_calls():
    text = ("Let me compute.\n" + call_text("calculator", {"expression": "6*7"})
            + "\nand\n" + call_text("python", {"code": "print(1)"}) + " trailing")
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "6*7"}), ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("no call here, just <tool_response> talk") == []


@pytest.mark.parametrize("text, words", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "calculator"}</tool_call>', "exactly the keys"),
    ('<tool_call>{"name": "c", "arguments": {}, "id": 1}</tool_call>', "exactly the keys"),
    ('<tool_call>{"name": "c", "arguments": "{\\"x\\": 1}"}</tool_call>', '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "non-empty string"),
    ('<tool_call>["calculator", {}]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "c", "arguments": {}}', "without </tool_call>"),
    ('{"name": "c", "arguments": {}}</tool_call>', "without <tool_call>"),
    ('<tool_call><tool_call>{"name": "c", "arguments": {}}</tool_call>', "inside another"),
])
def test_parse_malformed_calls(text, words):
    calls = parse_tool_calls(text)
    assert any(isinstance(c, MalformedCall) and words in c.error for c in calls), calls


# --- the chat template at the token level ------------------------------------------------------------

def test_qwen_template_passes_the_prefix_check(tokenizer, calc_tools):
    check_template(ChatFormat(tokenizer, calc_tools.schemas))
    check_template(ChatFormat(tokenizer))


def test_llama3_template_passes_the_prefix_check(calc_tools):
    check_template(ChatFormat(llama3_style_tokenizer(), calc_tools.schemas))
    check_template(ChatFormat(llama3_style_tokenizer()))


@pytest.mark.parametrize("make_tokenizer, observation", [
    (qwen_style_tokenizer, "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    # Llama 3.1's template writes a tool's text through tojson (a string is "iterable" to Jinja): quoted
    (llama3_style_tokenizer, '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>'
                             '<|start_header_id|>assistant<|end_header_id|>\n\n'),
])
def test_multiturn_trajectory_is_the_rendering_under_both_families(make_tokenizer, observation, calc_tools):
    """ChatML (Qwen2.5) and Llama 3.1: the loop's ids, turn by turn, are the template's rendering of the
    conversation; the observation is exactly what the template puts between two assistant turns."""
    tokenizer = make_tokenizer()
    replies = [[call_text("calculator", {"expression": "6*7"}), "It is 42."], ["No tools."]]
    chat, _, trajs = scripted_run(tokenizer, calc_tools, replies)
    for t in trajs:
        full = chat.render(t.messages, add_generation_prompt=False)   # ChatML adds a newline after the last EOS
        assert t.prompt_ids + t.response_ids == full[:len(t.prompt_ids) + len(t.response_ids)]
        assert t.response_ids[-1] == tokenizer.eos_token_id and len(full) - len(t.prompt_ids + t.response_ids) <= 1
        assert len(t.mask) == len(t.logprobs) == len(t.response_ids) and t.stop_reason == "done"
    t = trajs[0]
    first_end = t.mask.index(0)
    tool_part = t.response_ids[first_end:t.mask.index(1, first_end)]
    assert tokenizer.decode(tool_part) == observation


def test_template_that_rewrites_earlier_turns_is_refused():
    with pytest.raises(UserError) as e:
        check_template(ChatFormat(qwen_style_tokenizer("chatml_strips_reasoning.jinja")))
    assert "not prefix-preserving" in str(e.value) and "\n" not in str(e.value)


def test_template_without_tool_messages_is_refused():
    tok = qwen_style_tokenizer()
    tok.chat_template = ("{%- for m in messages %}{%- if m.role != 'tool' %}{{ '<|im_start|>' + m.role + '\n' + "
                         "m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")
    with pytest.raises(UserError, match="drops tool messages"):
        check_template(ChatFormat(tok))


def test_observation_tokens_are_the_templates_rendering(tokenizer, calc_tools):
    """Prompt + generated ids + observation ids, turn by turn, equal the template's rendering of
    the whole conversation, two tool results in one turn included."""
    chat = ChatFormat(tokenizer, calc_tools.schemas)
    messages = [{"role": "user", "content": "What are 6*7 and 2**10?"}]
    ids = chat.prompt_ids(messages)
    reply = call_text("calculator", {"expression": "6*7"}) + "\n" + call_text("calculator", {"expression": "2**10"})
    ids += tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    messages.append({"role": "assistant", "content": reply})
    observation = chat.observation_ids(messages, ["42", "1024"])
    ids += observation
    messages += [{"role": "tool", "content": "42"}, {"role": "tool", "content": "1024"}]
    assert ids == chat.render(messages, add_generation_prompt=True)
    assert tokenizer.decode(observation) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n"
                                             "<tool_response>\n1024\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


# --- the loop through a scripted engine ------------------------------------------------------------

class ScriptedEngine:
    """The rollout protocol with fixed replies: reply k of prompt row i is replies[i][k] (text; the
    EOS appended unless it ends with "..."), cut at max_tokens. Records every generate call."""
    name = "scripted"

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.calls = tokenizer, replies, []
        self.turn: dict[int, int] = {}

    def generate(self, prompts, params, share=None):   # a script: no random draws to key
        self.calls.append(([list(p) for p in prompts], params))
        responses = []
        for p in prompts:
            row = next((i for i, r in enumerate(self.rows) if p[:len(r)] == r), None)
            if row is None:                    # a filler pass
                responses.append([self.tokenizer.eos_token_id])
                continue
            k = self.turn.get(row, 0)
            self.turn[row] = k + 1
            text = self.replies[row][k]
            ids = self.tokenizer(text.removesuffix("..."), add_special_tokens=False)["input_ids"]
            responses.append((ids if text.endswith("...") else ids + [self.tokenizer.eos_token_id])[:params.max_tokens])
        return RolloutOutput(responses=responses, logprobs=[[-0.5] * len(r) for r in responses])


def scripted_run(tokenizer, tools, replies, max_response_length=10_000, max_turns=8, envs=None, prompts=None, **kw):
    chat = ChatFormat(tokenizer, tools.schemas)
    prompts = prompts or [[{"role": "user", "content": f"question {i}"}] for i in range(len(replies))]
    engine = ScriptedEngine(tokenizer, replies)
    engine.rows = [chat.prompt_ids(p) for p in prompts]
    envs = envs or [ToolEnvironment(tools) for _ in prompts]
    trajectories = run_multiturn(engine, chat, prompts, envs, SamplingParams(temperature=1.0, max_tokens=999),
                                 max_response_length, max_turns, **kw)
    return chat, engine, trajectories


@pytest.mark.parametrize("overlap, passes", [(False, [3, 2, 1]), (True, [2, 1, 2, 1])])
def test_loop_feeds_the_trajectory_and_counts_calls(tokenizer, calc_tools, overlap, passes):
    """With overlap the even and odd trajectories take turns at the engine: the same trajectories."""
    replies = [
        [call_text("calculator", {"expression": "6*7"}) + call_text("explode", {"x": "y"}), "It is 42."],
        ["No tools needed."],
        ['<tool_call>{"name": "calculator"}</tool_call>', call_text("calculator", {"expression": "1/0"}), "Undefined."],
    ]
    chat, engine, trajs = scripted_run(tokenizer, calc_tools, replies, overlap=overlap)
    assert [t.stop_reason for t in trajs] == ["done", "done", "done"]
    assert [(t.turns, t.tool_calls, t.tool_errors) for t in trajs] == [(2, 2, 1), (1, 0, 0), (3, 2, 2)]
    # every id fed to the engine is the trajectory so far; finished rows are not generated again
    assert [len(prompts) for prompts, _ in engine.calls] == passes
    fed = {tuple(p) for prompts, _ in engine.calls for p in prompts}
    for t in trajs:
        model_ends = [i + 1 for i in range(len(t.mask)) if t.mask[i] == 1 and (i + 1 == len(t.mask) or t.mask[i + 1] == 0)]
        for end in model_ends[:-1]:   # each turn's input = prompt + everything up to the observation's end
            nxt = next(j for j in range(end, len(t.mask) + 1) if j == len(t.mask) or t.mask[j] == 1)
            assert tuple(t.prompt_ids + t.response_ids[:nxt]) in fed
        assert tuple(t.prompt_ids) in fed
    # the whole trajectory is the template's rendering of the conversation, up to the last EOS
    for t in trajs:
        full = chat.render(t.messages, add_generation_prompt=False)
        assert (t.prompt_ids + t.response_ids) == full[:len(t.prompt_ids) + len(t.response_ids)]
        assert t.response_ids[-1] == tokenizer.eos_token_id
        assert len(t.mask) == len(t.logprobs) == len(t.response_ids)
        assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(t.logprobs, t.mask))
    first = tokenizer.decode(trajs[0].response_ids)
    assert "<tool_response>\n42\n</tool_response>" in first and "error: explode: RuntimeError: kaboom" in first
    assert "error: malformed tool call" in tokenizer.decode(trajs[2].response_ids)
    metrics = tool_metrics(trajs)
    assert metrics["tools/calls_per_sample"] == pytest.approx(4 / 3)
    assert metrics["tools/error_rate"] == pytest.approx(3 / 4)
    assert metrics["tools/turns_mean"] == pytest.approx(2.0) and metrics["tools/truncated_rate"] == 0.0


@pytest.mark.parametrize("cut", ["mid_generation", "mid_observation", "at_observation_end"])
def test_loop_token_budget_counts_tool_tokens(tokenizer, calc_tools, cut):
    replies = [[call_text("calculator", {"expression": "6*7"}), "It is 42."]]
    _, _, (full,) = scripted_run(tokenizer, calc_tools, replies)
    first_turn = full.mask.index(0)                        # model tokens of turn 1
    observation = full.mask.index(1, first_turn) - first_turn
    budget = {"mid_generation": first_turn - 5, "mid_observation": first_turn + observation // 2,
              "at_observation_end": first_turn + observation}[cut]
    _, engine, (t,) = scripted_run(tokenizer, calc_tools, replies, max_response_length=budget)
    assert len(t.response_ids) == len(t.mask) == len(t.logprobs) == budget
    assert t.response_ids == full.response_ids[:budget] and t.mask == full.mask[:budget]
    assert t.stop_reason == "length" and t.truncated and tool_metrics([t])["tools/truncated_rate"] == 1.0
    assert engine.calls[0][1].max_tokens == budget
    assert t.tool_calls == (0 if cut == "mid_generation" else 1)


@pytest.mark.parametrize("overlap, passes", [(False, 2), (True, 3)])
def test_loop_max_turns_and_no_stop(tokenizer, calc_tools, overlap, passes):
    call = call_text("calculator", {"expression": "1+1"})
    _, engine, (t, u) = scripted_run(tokenizer, calc_tools, [[call] * 5, ["thinking..."]], max_turns=2, overlap=overlap)
    assert (t.turns, t.tool_calls, t.stop_reason) == (2, 2, "max_turns")
    assert t.response_ids[-1] == tokenizer.eos_token_id and t.mask[-1] == 1   # no observation after the last turn
    assert (u.turns, u.stop_reason, u.mask) == (1, "no_stop", [1] * len(u.response_ids))
    assert len(engine.calls) == passes


def test_loop_runs_an_environment(tokenizer, calc_tools):
    env_cls = load_environment(f"{HERE}:CountdownEnv")
    _, _, (t,) = scripted_run(tokenizer, calc_tools, [["one", "two", "three", "four"]], envs=[env_cls()],
                              rows=[{"start": 7}], prompts=[[{"role": "user", "content": "ignored"}]])
    assert t.messages[0] == {"role": "user", "content": "count from 7"}
    assert (t.turns, t.env_reward, t.stop_reason, t.tool_calls) == (3, 3.0, "done", 0)
    assert "<tool_response>\n1 left\n</tool_response>" in tokenizer.decode(t.response_ids)


@pytest.mark.parametrize("overlap, passes", [(False, 4), (True, 5)])
def test_loop_filler_passes_keep_ranks_in_step(tokenizer, calc_tools, overlap, passes):
    """A rank whose trajectories finished keeps calling generate while another rank's go on; with
    overlap, the odd half's pass (empty here) is a filler pass too."""
    others = iter([True, True, True, False])     # what the other ranks report after each local pass
    _, engine, (t,) = scripted_run(tokenizer, calc_tools, [["done at once"]], overlap=overlap,
                                   any_active=lambda local: local or next(others))
    assert t.stop_reason == "done" and len(engine.calls) == passes
    assert all(len(p) == 1 and len(p[0]) == 1 and params.max_tokens == 1 for p, params in engine.calls[1:])


class Timeline:
    """The order of events, under one lock: generate calls starting and ending (recorded by the engine,
    on the loop's thread) and tool calls starting and ending (recorded by the tool itself, in its pool
    thread). A tool call starts after the generate call that wrote it ended; each one then waits, up to
    wait_s, until a generate call is running or starts: with overlap one does (the other half's pass,
    which does not wait for this call) and releases it; without, the loop waits for the call instead,
    and it ends at the timeout."""

    def __init__(self, wait_s: float):
        self.events, self.cond, self.wait_s, self.ids = [], threading.Condition(), wait_s, itertools.count()
        self.written = 0                    # tool calls in the replies generated so far

    def _record(self, kind, call=None):
        with self.cond:
            self.events.append((kind, call))
            self.cond.notify_all()

    def generate(self, generate, prompts, params, decode):
        """engine.generate, recorded. It first waits (up to wait_s) until every tool call written by the
        earlier passes has started: with overlap they are in the pool by now, and a fast engine would
        otherwise be done before a pool thread gets going; without, they have all ended already."""
        with self.cond:
            self.cond.wait_for(lambda: self._count("tool_start") >= self.written, timeout=self.wait_s)
        self._record("generate_start")
        try:
            out = generate(prompts, params)
        finally:
            self._record("generate_end")
        self.written += sum(decode(r).count("<tool_call>") for r in out.responses)
        return out

    def _count(self, kind):
        return sum(k == kind for k, _ in self.events)

    def tool(self):
        timeline = self

        def calculator(expression: str) -> str:
            with timeline.cond:
                call = next(timeline.ids)
                timeline.events.append(("tool_start", call))
                timeline.cond.notify_all()
                ended = timeline._count("generate_end")    # the generate call that wrote this one is among them
                timeline.cond.wait_for(lambda: timeline._count("generate_start") > ended, timeout=timeline.wait_s)
                timeline.events.append(("tool_end", call))
            return builtin_calculator(expression)
        calculator.__doc__ = builtin_calculator.__doc__    # the same schema: what the memorised model was shown
        return calculator

    def overlapped_calls(self) -> set:
        """The tool calls during which the engine was generating (a call running at its start or started before its end)."""
        in_flight, overlapped, generating = set(), set(), False
        for kind, call in self.events:
            if kind == "tool_start":
                in_flight.add(call)
                if generating:
                    overlapped.add(call)
            elif kind == "tool_end":
                in_flight.discard(call)
            else:
                generating = kind == "generate_start"
                overlapped |= in_flight if generating else set()
        return overlapped

    def tool_calls(self) -> int:
        return self._count("tool_start")


class TimedScriptedEngine(ScriptedEngine):
    def generate(self, prompts, params, share=None):
        return self.timeline.generate(super().generate, prompts, params, self.tokenizer.decode)


@pytest.mark.parametrize("overlap", [False, True])
def test_loop_overlaps_tool_calls_with_generation(tokenizer, overlap):
    """With overlap, every tool call is still running when the engine starts generating for the other
    half (structural: the events' order, not a duration); without, no generate call starts while a
    tool call runs. The trajectories are the same either way."""
    timeline = Timeline(wait_s=30 if overlap else 0.05)
    tools = ToolSet([timeline.tool()])
    replies = [[call_text("calculator", {"expression": f"{i}*7"}), f"It is {i * 7}."] for i in range(4)]
    chat = ChatFormat(tokenizer, tools.schemas)
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]
    engine = TimedScriptedEngine(tokenizer, replies)
    engine.rows, engine.timeline = [chat.prompt_ids(p) for p in prompts], timeline
    trajectories = run_multiturn(engine, chat, prompts, [ToolEnvironment(tools) for _ in prompts],
                                 SamplingParams(temperature=1.0), 10_000, 4, overlap=overlap, tool_workers=4)
    assert timeline.tool_calls() == 4
    assert timeline.overlapped_calls() == ({0, 1, 2, 3} if overlap else set())
    for i, t in enumerate(trajectories):
        assert (t.turns, t.tool_calls, t.tool_errors, t.stop_reason) == (2, 1, 0, "done")
        assert t.prompt_ids + t.response_ids == chat.render(t.messages, add_generation_prompt=False)[:len(t.prompt_ids) + len(t.response_ids)]
        assert f"<tool_response>\n{i * 7}\n</tool_response>" in tokenizer.decode(t.response_ids)


# --- the loop through the real hf engine on a tiny Qwen2 --------------------------------------------

MEMORISED = [("What is 6*7?", [call_text("calculator", {"expression": "6*7"}), "It is 42."]),
             ("Say hi.", ["hi"])]


@pytest.fixture(scope="module")
def memorised(tokenizer, calc_tools):
    return memorise(tokenizer, calc_tools)


def memorise(tokenizer, calc_tools, conversations=MEMORISED, kv_heads=1):
    """A tiny Qwen2 (head_dim 32, which vLLM's CPU attention supports) that reproduces the
    conversations' assistant turns (every model token at probability > 0.9), and each
    conversation's token ids as the template renders them. kv_heads 2: a model sequence
    parallelism of 2 can split (heads and key-value heads divisible by 2).

    Constructed, not trained (`constructed`): the same model on every CPU in a second or two, where
    training by Adam took tens of seconds and its path differs from one CPU to another."""
    chat = ChatFormat(tokenizer, calc_tools.schemas)
    rows = []
    for question, turns in conversations:
        messages = [{"role": "user", "content": question}]
        ids, model = chat.prompt_ids(messages), []
        for k, reply in enumerate(turns):
            reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            model += range(len(ids), len(ids) + len(reply_ids))
            ids += reply_ids
            messages.append({"role": "assistant", "content": reply})
            if k < len(turns) - 1:
                texts = [calc_tools.run(c).text for c in parse_tool_calls(reply)]
                ids += chat.observation_ids(messages, texts)
                messages += [{"role": "tool", "content": t} for t in texts]
        rows.append((len(chat.prompt_ids(messages[:1])), ids, model))
    return chat, constructed(tokenizer, rows, kv_heads), rows


def constructed(tokenizer, rows, kv_heads):
    """A Qwen2 that gives each model token of rows (prompt_len, ids, model positions) probability >
    0.9 by construction, no optimiser: a random body wider than the number of model tokens, whose
    last hidden states before them are then linearly independent, and an LM head solved by least
    squares for the logits 12 * onehot(the next token) at each of them."""
    n_model = sum(len(positions) for _, _, positions in rows)
    heads = 2 * (n_model // 64 + 2)                  # hidden = 32 * heads > the number of model tokens
    config = Qwen2Config(vocab_size=264, hidden_size=32 * heads, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    width = max(len(ids) for _, ids, _ in rows)
    x = torch.full((len(rows), width), tokenizer.pad_token_id)                       # [B, L]
    attention = torch.zeros_like(x)                                                  # [B, L]
    for r, (_, ids, _) in enumerate(rows):
        x[r, :len(ids)], attention[r, :len(ids)] = torch.tensor(ids), 1
    with torch.no_grad():
        hidden = model.model(input_ids=x, attention_mask=attention).last_hidden_state   # [B, L, H]
        before = [(r, p - 1) for r, (_, _, positions) in enumerate(rows) for p in positions]
        features = torch.stack([hidden[r, p] for r, p in before]).double()           # [n, H]
        wanted = torch.tensor([x[r, p + 1] for r, p in before])                      # [n]
        logits = 12.0 * torch.nn.functional.one_hot(wanted, config.vocab_size).double()   # [n, V]
        model.lm_head.weight.copy_(torch.linalg.lstsq(features, logits).solution.T.float())   # [V, H]
        logp = torch.log_softmax(model(input_ids=x, attention_mask=attention).logits, -1)   # [B, L, V]
        got = torch.stack([logp[r, p, x[r, p + 1]] for r, p in before])              # [n]
    assert got.exp().min() > 0.9, "the constructed LM head does not reproduce the conversations"
    return model


def hf_run(memorised, calc_tools, **limits):
    from rollout.hf import HFEngine
    chat, model, _ = memorised
    engine = HFEngine(model, chat.tokenizer.eos_token_id, chat.tokenizer.pad_token_id)
    torch.manual_seed(0)
    # temperature 0.1 sharpens p > 0.9 into a certainty; sampled (not greedy) so log-probs come back
    return run_multiturn(engine, chat, [[{"role": "user", "content": q}] for q, _ in MEMORISED],
                         [ToolEnvironment(calc_tools) for _ in MEMORISED], SamplingParams(temperature=0.1),
                         **{"max_response_length": 1000, "max_turns": 4, **limits})


@pytest.mark.slow
def test_hf_engine_trajectory_is_the_templates_rendering(memorised, calc_tools):
    trajectories = hf_run(memorised, calc_tools)
    for t, (prompt_len, ids, model_positions) in zip(trajectories, memorised[2]):
        assert t.prompt_ids == ids[:prompt_len]
        assert t.prompt_ids + t.response_ids == ids              # tool tokens exactly as the template renders them
        assert [i + prompt_len for i, m in enumerate(t.mask) if m] == model_positions
        assert len(t.logprobs) == len(t.mask) == len(t.response_ids)
        assert all(math.isfinite(lp) and (lp <= 0 if m else lp == 0.0) for lp, m in zip(t.logprobs, t.mask))
        assert t.stop_reason == "done"
    assert [(t.turns, t.tool_calls, t.tool_errors) for t in trajectories] == [(2, 1, 0), (1, 0, 0)]
    assert "<tool_response>\n42\n</tool_response>" in memorised[0].tokenizer.decode(trajectories[0].response_ids)


@pytest.mark.slow
def test_hf_engine_budget_and_turn_limits(memorised, calc_tools):
    prompt_len, ids, model_positions = memorised[2][0]
    first_turn = next(i for i, (a, b) in enumerate(zip(model_positions, model_positions[1:])) if b != a + 1) + 1
    budget = first_turn + 4                                   # cut four tokens into the observation
    cut = hf_run(memorised, calc_tools, max_response_length=budget)
    assert len(cut[0].response_ids) == len(cut[0].mask) == len(cut[0].logprobs) == budget
    assert cut[0].prompt_ids + cut[0].response_ids == ids[:prompt_len + budget]
    assert cut[0].mask == [1] * first_turn + [0] * 4 and cut[0].stop_reason == "length"
    assert cut[1].stop_reason == "done"                       # the short one is untouched
    one_turn = hf_run(memorised, calc_tools, max_turns=1)
    assert (one_turn[0].turns, one_turn[0].stop_reason, len(one_turn[0].response_ids)) == (1, "max_turns", first_turn)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_hf_engine_overlaps_tool_calls(memorised, overlap):
    """The real hf engine: with overlap, each calculator call is running while the engine generates for
    the other half; the trajectories are still exactly the template's rendering, either way."""
    from rollout.hf import HFEngine

    class TimedHFEngine(HFEngine):
        def generate(self, prompts, params, share=None):
            return timeline.generate(functools.partial(super().generate, share=share), prompts, params,
                                     chat.tokenizer.decode)

    chat, model, rows = memorised
    timeline = Timeline(wait_s=60 if overlap else 0.05)
    tools = ToolSet([timeline.tool(), explode])   # calc_tools' schemas, which the model saw
    chat = ChatFormat(chat.tokenizer, tools.schemas)
    order = [0, 0, 1, 1]                      # halves {0, 2} and {1, 3}: a calculator prompt in each
    torch.manual_seed(0)
    trajectories = run_multiturn(TimedHFEngine(model, chat.tokenizer.eos_token_id, chat.tokenizer.pad_token_id), chat,
                                 [[{"role": "user", "content": MEMORISED[k][0]}] for k in order],
                                 [ToolEnvironment(tools) for _ in order], SamplingParams(temperature=0.1),
                                 1000, 4, overlap=overlap)
    assert timeline.tool_calls() == 2
    assert timeline.overlapped_calls() == ({0, 1} if overlap else set())
    for t, k in zip(trajectories, order):
        prompt_len, ids, model_positions = rows[k]
        assert t.prompt_ids + t.response_ids == ids
        assert [i + prompt_len for i, m in enumerate(t.mask) if m] == model_positions
        assert len(t.logprobs) == len(t.mask) == len(t.response_ids)
