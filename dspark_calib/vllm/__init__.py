"""The vLLM wing: everything that runs inside a vLLM process, or starts one.

plugin.py is the entry point vLLM calls in every process; the modes (load, capture,
observer, context_aware) share runtime.py and never import the entry point; profile/
drives `dspark-calib profile`. Importing this package imports nothing heavy: vllm and
torch are imported inside functions, once a mode runs. The core never imports this
package (pyproject.toml's import contracts check both).
"""
