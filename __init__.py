"""normtune: autotuned LayerNorm/RMSNorm kernels (`normtune.kernels`) and the service that tunes them
(`normtune.tuner`, the `normtune` CLI).

    import normtune
    normtune.patch(model)        # the model's LayerNorms and RMSNorms now run normtune's kernels

`patch` and `normtune.kernels` are loaded on first use: importing `normtune` (e.g. for the CLI) imports neither
torch nor triton, so that a command can still set TRITON_INTERPRET before the kernels are compiled.
"""

__all__ = ["kernels", "patch"]


def __getattr__(name: str):
    if name == "patch":
        from .kernels.patching.patch import patch

        return patch
    if name == "kernels":
        import importlib

        return importlib.import_module(f"{__name__}.kernels")
    raise AttributeError(f"module 'normtune' has no attribute {name!r}")
