"""Whether what a run says is what opalctl wrote: a run folder read (``folder.py``), its chain of digests from the
lock to the verdict checked by pure functions (``chain.py``), and the ``opalctl verify`` command over a lock, a run
folder or a lock's runs (``command.py``). The lock's own re-check lives with the lock (``protocol/recheck.py``).
"""
