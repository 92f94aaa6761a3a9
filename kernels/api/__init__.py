"""The public call path, for every form (`forms.py`): the functions (`functional`), the modules (`modules`), the
functions without autograd (`direct`), the custom ops and the autograd Function (`ops`), the checks of a call's
arguments (`call_checks`), forward calls planned per signature (`forward_calls`), a backward resolved once per
signature (`backward_calls`), and the PyTorch forms of the math (`composite`: differentiable, `reference`: the path
off Triton) with the rule for saving y (`saving`). It reads the selection (`select/`), the kernels (`forward`,
`backward/`) and the values below them; nothing below imports it."""
