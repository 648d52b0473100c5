"""Runtime: runs a program the compiler lowered, on one rank; imports only :mod:`autopar.ir` and torch.

``lowered`` (what the compiler hands over), ``module`` (``DistributedModule``), ``grad_reducer``
(bucketed gradient sums), ``materialize`` (weights and this rank's pieces), ``offload``
(activations on the host), ``optimizer`` (ZeRO and optimizer offload), ``loss_scaler`` (fp16
loss scaling), ``pipeline_runtime`` (stage programs and torch's schedules), ``collectives`` (the
program's per-axis ops). It never plans or runs passes: loss functions are compiled through the
``LossCompiler`` interface ``module`` declares, which the compiler implements and hands over.
"""
