"""The torch-facing layer: torch custom ops with autograd and fake (meta) implementations, so
gpuops kernels work inside ``torch.compile`` graphs and training. The memory-bound family's
backward kernels (softmax, norms, RoPE, cross-entropy, gated activations) land here; the plain
``gpuops.<op>`` functions refuse inputs that require grad rather than drop the gradient."""
