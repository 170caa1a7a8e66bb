"""The llama.cpp edge: the runtime (the only module that imports llama_cpp), the two builds
(fast and exact), models on rpc servers, the thread controller and listening addresses."""
