"""FlexAttention path of the jagged attention: block masks built from offsets, and the compiled kernel call.
Imported lazily by kernels.attention; the block-mask builder runs on the host and needs only torch."""
