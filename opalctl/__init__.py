"""opalctl: an experiment driver for one question.

Does an agent that rewrites the optimizer while a model trains beat a fixed optimizer, at the same compute, on
my task? The package is split so that each part can be read on its own: ``protocol`` (what was promised and
frozen), ``tasks`` (what is trained), ``driver`` (how a budget is spent and measured), ``opal`` (the agent
optimizer) and ``compare`` (what the runs say together). Nothing here imports torch at module level, so that
``opalctl --help`` stays instant.
"""

__version__ = "0.1.0"
