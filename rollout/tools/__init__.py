"""Multi-turn rollouts with tools (issue 22): the model calls a tool mid-answer, reads the result
and goes on, token in and token out.

    spec.py      a tool (typed, documented function) or environment (reset/step class) from "module:name"
    builtin.py   calculator (ast, no eval) and python (subprocess with limits, no network)
    parsing.py   <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, strictly
    toolset.py   validate a call against the tool's schema, run it, always get observation text back
    chat.py      the tokenizer's chat template at the token level; the prefix check at startup
    loop.py      run_multiturn: the trajectories, masks and sampler log-probs; tool_metrics
"""
from rollout.tools.builtin import PythonLimits, ToolError, calculator, make_python_tool, python, run_python
from rollout.tools.chat import ChatFormat, check_template
from rollout.tools.loop import ToolEnvironment, Trajectory, run_multiturn, tool_metrics
from rollout.tools.parsing import MalformedCall, ToolCall, parse_tool_calls
from rollout.tools.spec import Environment, load_environment, load_tool, tool_schema
from rollout.tools.toolset import ToolResult, ToolSet
