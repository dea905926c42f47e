"""The model an agent arm uses when its protocol names none, and the effort it asks of it.

It is also the model whose per-decision time and cost ``opalctl.opal.estimate`` holds measured figures for, so a
run on the defaults is forecast with figures of its own model. This module imports nothing: the command line
shows these names in ``--help`` without loading pydantic or torch.
"""

DEFAULT_MODEL = "claude-opus-5-5"
DEFAULT_EFFORT = "high"
