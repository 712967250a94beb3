"""What every call of the servicer goes through: parsing, the caller's checks, and the status of a refusal.

:func:`refusals` wraps each servicer method: everything below the RPC layer
refuses with :mod:`pserver.errors` exceptions, and :data:`STATUS` is the one
place they become gRPC status codes; any other exception is a bug, answered
INTERNAL with its traceback logged. :func:`trainer_call` adds the prologue a
trainer's unary call shares (parse, trainer id and session, layout digest,
sign of life), with :class:`CallerChecks`, the checks every servicer of the
service shares; :func:`read_stream` is a client stream's (its header first).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable, Dict, Optional, Sequence, Tuple

import grpc
from google.protobuf.message import DecodeError

from psproto.codec import TensorReader, WireError, decode_chunk
from psproto.shared_memory import SharedMemoryError

from ..errors import (
    AlreadyRunning,
    BadRequest,
    BarrierTimeout,
    Fenced,
    Moved,
    MustResync,
    NoSession,
    NotAllowed,
    NotPrimary,
    OutOfSync,
    ShuttingDown,
    StorageFailed,
    Unauthenticated,
)
from ..layout.phases import LayoutStatus

# Under the servicer's name: these are its calls' records, and operators filter its log by that name
# (every servicer of the service logs under it: :mod:`.service`).
CALLS_LOG = "pserver.rpc.servicer"
log = logging.getLogger(CALLS_LOG)

# The status each kind of refusal is answered with. Looked up along the
# exception's MRO, so a subclass answers as its parent; an exception of no
# listed kind (a plain ValueError included) is a bug and answered INTERNAL.
STATUS: Dict[type, grpc.StatusCode] = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    WireError: grpc.StatusCode.INVALID_ARGUMENT,  # bytes the codec cannot read as the message
    # Regions this pserver cannot map: the trainer sends its bytes through gRPC instead (the
    # status a pserver without PushPullShared answers too).
    SharedMemoryError: grpc.StatusCode.UNIMPLEMENTED,
    NotAllowed: grpc.StatusCode.FAILED_PRECONDITION,
    StorageFailed: grpc.StatusCode.FAILED_PRECONDITION,
    MustResync: grpc.StatusCode.ABORTED,  # the code trainers answer with Hello, then carry on
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,  # trainers retry it against the restarted pserver
    BarrierTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    NoSession: grpc.StatusCode.FAILED_PRECONDITION,
    Fenced: grpc.StatusCode.PERMISSION_DENIED,  # the one status trainers stop at: "fenced: ..."
    AlreadyRunning: grpc.StatusCode.ALREADY_EXISTS,  # trainers retry it for one alive window
    # Hot standby: a replica that does not lead answers as a pserver that is down; trainers then
    # ask the shard's processes who leads (Lead) and go there.
    NotPrimary: grpc.StatusCode.UNAVAILABLE,
    # A change of layout: the answer names the job's layout now; trainers adopt it and call there.
    Moved: grpc.StatusCode.NOT_FOUND,
    OutOfSync: grpc.StatusCode.OUT_OF_RANGE,  # the primary drops this backup, which copies its state again
    # The data port's token check (the gRPC port's is an interceptor, which answers the same status).
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def status_of(error: BaseException) -> Optional[grpc.StatusCode]:
    """The status ``error`` is answered with per :data:`STATUS`, or None for an unexpected exception."""
    for cls in type(error).__mro__:
        code = STATUS.get(cls)
        if code is not None:
            return code
    return None


class CallerChecks:
    """What a servicer checks of a call before it acts: this process serves, the trainer id, session and plan.

    Shared by the servicers of the service (:mod:`.service`): ``trainers`` the job's trainer count,
    ``sessions`` the :class:`~.sessions.Sessions` of this pserver, ``replica`` its place in a replicated
    shard (None without replicas), ``layout_digest`` the plan it runs, ``layout_epoch`` that plan's
    layout epoch and ``pservers`` its pservers (``replicas`` their backups), ``layout_status`` the job's
    change of layout in progress (docs/operations.md, "Growing and shrinking a job").
    """

    def __init__(
        self,
        endpoint: str,
        trainers: int,
        sessions,
        replica,
        layout_digest: str,
        layout_epoch: int = 0,
        pservers: Sequence[str] = (),
        layout_status: Callable[[], object] = LayoutStatus,
        replicas: Sequence[str] = (),
    ):
        self.endpoint = endpoint
        self.layout_status = layout_status
        self.trainers = trainers
        self.sessions = sessions
        self.replica = replica
        self.layout_digest = layout_digest
        self.layout_epoch = layout_epoch
        self.pservers = list(pservers)
        self.replicas = list(replicas)

    def serving(self) -> None:
        """Refuse a trainer's call (NotPrimary) on a replica that does not lead its shard."""
        if self.replica is not None:
            self.replica.check_serving()

    def acked(self) -> None:
        """Before an answer that reports the pserver's step: the backup holds every one of them."""
        if self.replica is not None:
            self.replica.wait_acked()

    def trainer(self, trainer_id: int) -> None:
        """Refuse a trainer id out of the job's range."""
        if not 0 <= trainer_id < self.trainers:
            raise BadRequest(f"trainer id {trainer_id} is out of range [0, {self.trainers})")

    def caller(self, request) -> None:
        """A trainer's call (anything but Hello and Stats): served here, its id in range, its session
        current."""
        self.serving()
        self.trainer(request.trainer_id)
        self.sessions.check(request.trainer_id, request.session)

    def epoch(self, epoch: int) -> None:
        """A trainer of an earlier layout epoch is told where the job runs now (:class:`Moved`); one of a
        later epoch reached this process before it moved on to that layout (a backup still in the one that
        ended, or the next layout starting on these ports): it asks again (:class:`ShuttingDown`); an epoch
        the job's record never named is refused (:class:`BadRequest`)."""
        if epoch < self.layout_epoch:
            raise Moved(
                f"pserver {self.endpoint}: the job left layout epoch {epoch}",
                self.layout_epoch,
                self.pservers,
                self.replicas,
            )
        if epoch > self.layout_epoch:
            recorded = self.layout_status().epoch
            if epoch > recorded:  # no layout the job ever had
                raise BadRequest(
                    f"layout epoch {epoch} is later than the job's ({recorded}); "
                    f"pserver {self.endpoint} serves epoch {self.layout_epoch}"
                )
            raise ShuttingDown(
                f"pserver {self.endpoint} serves layout epoch {self.layout_epoch}, not yet the caller's "
                f"{epoch}: ask again"
            )

    def digest(self, digest: str) -> None:
        """Refuse a call made for another plan than this pserver's."""
        if digest != self.layout_digest:
            raise NotAllowed(
                f"pserver {self.endpoint}: plan mismatch (layout digest {digest!r}, "
                f"this pserver runs {self.layout_digest!r}); transpile the same "
                f"program with the same config, pservers and trainers on every role"
            )


def refusal_of(error: BaseException) -> Tuple[str, grpc.StatusCode]:
    """(reason, status) a refusal is counted under: its kind and :data:`STATUS` code, else an internal
    error."""
    code = status_of(error)
    return (type(error).__name__, code) if code is not None else ("internal", grpc.StatusCode.INTERNAL)


def parse(message_type, data: bytes):
    try:
        return message_type.FromString(data)
    except DecodeError as e:
        raise WireError(f"malformed {message_type.__name__}: {e}") from None


def refusals(method):
    """Answer every exception of a servicer method with a status (plain and server-streaming methods).

    A refusal gets its :data:`STATUS` code and its message, naming this
    pserver once. Anything else gets INTERNAL and its traceback in the log,
    naming the pserver and the method. Both count as refused. A
    ``grpc.RpcError`` (the client cancelled while we read its stream) is
    gRPC's own and passes through.
    """
    name = method.__name__

    def abort(self, context, e):
        code = status_of(e)
        self.counters.refuse(
            type(e).__name__ if code is not None else "internal",
            code if code is not None else grpc.StatusCode.INTERNAL,
        )
        where = f"pserver {self.endpoint}"
        if code is None:
            log.exception(
                "%s: %s failed with an unexpected %s; answered INTERNAL", where, name, type(e).__name__
            )
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"{where}: internal error in {name} ({type(e).__name__}: {e}); see the pserver's log",
            )
        text = str(e)
        # Engine refusals name the pserver themselves; request checks below it cannot know it.
        context.abort(code, text if text.startswith(where) else f"{where}: {text}")

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self, request, context):
            try:
                yield from method(self, request, context)
            except grpc.RpcError:
                raise
            except Exception as e:  # noqa: BLE001 - each one answered with a status
                abort(self, context, e)

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as e:  # noqa: BLE001 - each one answered with a status
            abort(self, context, e)

    return wrapper


def trainer_call(message_type, digest: bool = True, touch: bool = False):
    """A trainer's unary-request method with the prologue every such call shares, then :func:`refusals`.

    The prologue parses the request (``message_type``), checks the caller (its
    trainer id in range, its session current: the servicer's ``checks``, a
    :class:`CallerChecks`), then, when asked, the layout digest (``digest``) and
    notes the call as a sign of life (``touch``); the method gets the parsed
    request. Client streams have theirs in :func:`read_stream`.
    """

    def wrap(method):
        def prologue(self, data):
            request = parse(message_type, data)
            self.checks.caller(request)
            if digest:
                self.checks.digest(request.layout_digest)
            if touch:
                self.engine.touch(request.trainer_id)
            return request

        if inspect.isgeneratorfunction(method):

            @functools.wraps(method)
            def streamed(self, data, context):
                yield from method(self, prologue(self, data), context)

            return refusals(streamed)

        @functools.wraps(method)
        def unary(self, data, context):
            return method(self, prologue(self, data), context)

        return refusals(unary)

    return wrap


def read_stream(
    request_iterator,
    header_type,
    expect,
    check: Callable[[object], None],
    release: Callable[[dict], None],
    dest=None,
    widen: bool = False,
):
    """(header, reader) of a client stream: the header first (``check(header)``: the caller's checks), then
    pieces.

    ``expect``, ``dest``: the :class:`~psproto.codec.TensorReader`'s; ``widen``: float tensors may come
    narrower than expected (gradients pushed in ``grad_wire_dtype``) and are widened on arrival. On a
    failure the tensors read so far go to ``release``.
    """
    kind = header_type.__name__.replace("Header", "").lower()
    first = next(request_iterator, None)
    header = None
    if first is not None:
        header, pieces = decode_chunk(first, header_type)
    if header is None:
        raise BadRequest(f"a {kind} must open with a header (trainer_id, step, layout_digest)")
    check(header)
    reader = TensorReader(expect, dest=dest, widen=widen)
    try:
        for piece in pieces:
            reader.add(piece)
        for data in request_iterator:
            extra, pieces = decode_chunk(data, header_type)
            if extra is not None:
                raise BadRequest(f"a {kind} carries exactly one header, in its first message")
            for piece in pieces:
                reader.add(piece)
        reader.finish()
    except BaseException:
        release(reader.tensors)
        raise
    return header, reader
