"""Where this process's role comes from: one module per cluster engine, tried in a fixed order.

Each source is a pure function ``mapping -> Optional[Role]``: None when the environment is
not its engine's, a :class:`~transpiler.roles.common.Role` when it is, ValueError naming the
variable when it is its engine's but incomplete or contradictory. :func:`discover` asks them
in this order (:data:`SOURCES`) and the first answer wins:

1. ``paddle``  explicit Paddle/ps-launch roles: ``TRAINING_ROLE`` and this process's own place,
   ``PADDLE_TRAINER_ID`` (trainer) or ``PADDLE_PORT`` (pserver) (:mod:`.paddle`)
2. ``kubeflow``  ``TF_CONFIG``, as Kubeflow's TFJob operator writes it (:mod:`.kubeflow`)
3. ``kubernetes``  StatefulSet ordinals and Indexed Job indexes with the ``PS_PSERVER_*``
   variables (:mod:`.kubernetes`)
4. ``slurm``  ``SLURM_PROCID`` and the step's layout with ``PS_PSERVER_NUM``, or a
   heterogeneous job (:mod:`.slurm`)
5. ``torchrun``  torchrun's node variables, for trainers (:mod:`.torchrun`)

With none of them, a set ``TRAINING_ROLE`` means the Paddle variables (whose errors then say
what is missing); an unset one means no role at all (None: a local run). ``TRAINING_ROLE``,
when set, must agree with the engine's answer; an engine that starts torchrun comes before it
(the engine names the trainer, torchrun only the node's processes).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Tuple

from . import kubeflow, kubernetes, paddle, slurm, torchrun
from .common import Role, training_role

Source = Callable[[Mapping[str, str]], Optional[Role]]
SOURCES: Tuple[Tuple[str, Source], ...] = (
    ("paddle", paddle.explicit),
    ("kubeflow", kubeflow.discover),
    ("kubernetes", kubernetes.discover),
    ("slurm", slurm.discover),
    ("torchrun", torchrun.discover),
)


def discover(env: Mapping[str, str]) -> Optional[Role]:
    """This process's role from ``env`` by the first source that claims it (see the order above).

    None when no source claims it and ``TRAINING_ROLE`` is unset. Raises ValueError naming
    the variable that is malformed, missing or contradicts another.
    """
    training_role(env)  # an unknown role is an error whichever source answers
    for _, source in SOURCES:
        found = source(env)
        if found is not None:
            return found
    return paddle.read(env)
