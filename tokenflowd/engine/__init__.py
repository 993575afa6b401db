"""One engine: the step loop (core), its scheduler and requests, the executor seam and the model
runner; model/ (the decoder, its loaders, quantization), attention/ (torch, flashinfer) and
process/ (the engine process: zmq in, steps, deltas out)."""
