"""The decoding core: the round loop (engine), the verifiers and drafters, sampling, the cost
model and draft-length control, and the stats. Pure Python and numpy: nothing here imports
llama.cpp; a target is anything with the Runtime's decode/truncate interface."""
