"""Steppers: the ways a trainer takes a step, each behind one interface, :class:`~.stepper.Stepper`.

A trainer picks one at construction, and each moves the same :class:`~.state.StepState` (:mod:`.state`):

- :class:`~.local.LocalStepper` (:mod:`.local`): push-pull after backward, or streamed during it
  (:mod:`.overlap`), waiting for the answer; the default;
- :class:`~.pipelined.PipelinedStepper` (:mod:`.pipelined`): async mode's pipeline, the push-pull sent in
  the background;
- :class:`~.node.NodeStepper` (:mod:`.node`): one local process of a trainer node, reducing gradients
  inside the node first;
- :class:`~.geo.GeoStepper` (:mod:`.geo`): GEO mode, the optimizer run on the trainer and the change
  pushed every ``k_steps`` steps.

:mod:`.transfers` sends a step's push, pulls and row fetches to every pserver in parallel.
"""
