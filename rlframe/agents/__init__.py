"""Tools for multi-turn agentic RL: tool definitions and their registry (tools.py), tool calls parsed
out of generated text (calls.py), the sandboxed runner that executes them (sandbox.py; its worker process,
tool_worker.py) and the built-in calculator (calculator.py). The agent loop that uses them is
rlframe/controller/trainers/agent_loop.py."""
