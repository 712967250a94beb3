"""TensorBoard scalars of a job, written by its trainers (docs/tensorboard.md).

- ``settings.py``: where, from which processes and how often (the config's
  fields, else ``PS_TENSORBOARD_*``); pure, and free of torch for ``ps-launch``;
- ``writer.py``: :class:`~trainer.board.writer.Board`, one process's writer,
  and :func:`~trainer.board.writer.open_board`, which gives a do-nothing board
  when the process does not write or ``tensorboard`` is not installed;
- ``meter.py``: the step time split, steps and examples over a window;
- ``pserver_stats.py``: trainer 0's Stats rounds over the pservers, on one
  background thread, and the tags of a reply.

Nothing is imported here, so importing ``trainer.board.settings`` loads no torch.
"""
