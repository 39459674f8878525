"""What the partitioners (``zeroio.partition``) and the optimizers (``zeroio.optim``) share.

This layer sits below both, so neither imports the other: the shard types
(``types``: ``ShardGroup``, ``Segment``, ``ParamIndex``), the host-gradient dtype rule
(``host_grads``), the step assist (``assist``: the GPU's share of a host optimizer step),
the gradient landing and the host-step chunk plan that stages 1/2 and 3 both use.
Nothing is imported here, so ``zeroio.shard.host_rule`` stays importable without torch.
"""
