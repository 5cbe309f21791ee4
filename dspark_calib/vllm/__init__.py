"""Everything that imports vllm (and with it torch) lives in this subpackage.

Importing this package itself imports nothing heavy: the plugin entry point
(`plugin.register`) is called by vLLM in every process, and the CLI imports the
profile driver only when `dspark-calib profile` runs.
"""
