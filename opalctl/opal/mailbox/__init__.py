"""The mailbox: decisions of an agent arm asked in a folder and answered by ``opalctl agent serve`` elsewhere.

``folder`` holds the file operations a mailbox stands on (a local or shared folder, or one reached over ssh);
``box`` the layout of the mailbox and its leases; ``serve`` the server that answers (``opalctl agent serve``). The
training side is the ``mailbox`` backend (``opalctl.opal.agents.mailbox``).
"""
