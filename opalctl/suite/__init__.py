"""``opalctl suite``: one comparison over several tasks (docs/suite.md).

A suite file names the tasks (a built-in task or a protocol file, each with its budget rule, its target and
overrides) and the arms every task runs (``spec``); ``freeze`` writes each task's protocol and lock and the suite
lock naming them by digest (``freeze``, ``lock``); ``run`` runs every task's grid, resumable (``run``); ``summary``
reads each task's comparison and the performance profiles of the arms across tasks (``summary``), and ``page``
writes them as one HTML page.
"""
