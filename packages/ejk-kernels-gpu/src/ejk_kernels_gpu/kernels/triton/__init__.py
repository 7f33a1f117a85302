"""The Triton kernels: flash forward (`_forward`) and backward (`_backward`) on shared device
functions (`_common`), the split-KV paged kernel (`_paged`) and the segment-table kernel."""
