"""The mailbox: decision requests and answers that cross between a training job and ``opalctl agent serve`` through
a folder, shared (``folder.LocalMailboxFolder``) or reached over ssh (``ssh.SshMailboxFolder``)."""
