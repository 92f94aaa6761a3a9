"""`normtune.patch(model)`: swapping a model's norms for normtune's (`patch`), each layer's forward checked by
probing it (`patch_probe`), the gated RMSNorms of hybrid models (`patch_gated`), and the fused residual add of
pre-norm layers (`patch_residual`, the two layer forms it fuses in `patch_forms`). It sits on top of the call path (`api/`); nothing in kernels/ imports it but the
package's own `__init__`."""
