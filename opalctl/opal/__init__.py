"""The agent optimizer: an optimizer whose update rule an agent may rewrite while the model trains."""
