"""Stands in for a machine without llama.cpp's native build: `PYTHONPATH=.ci/no-native` makes
every import of llama_cpp fail, in the test process and in the commands it runs, so that
`pytest -m "not slow"` proves the fast suite needs neither llama.cpp nor a model."""

raise ImportError("llama_cpp is hidden on purpose (.ci/no-native): this test needs the native build; mark it slow")
