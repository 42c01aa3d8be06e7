"""Kineto (torch.profiler) traces in and out.

:mod:`.write` turns parsim's traces, predicted or measured, into per-rank
Kineto files that Perfetto and Holistic Trace Analysis read; :mod:`.read`
turns a folder of torch.profiler traces of any run into parsim's trace schema
so ``parsim compare --measured`` can set it beside a prediction.
"""
