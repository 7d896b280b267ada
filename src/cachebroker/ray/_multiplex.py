"""``@multiplexed``: a model loader whose models a broker keeps, leased per request.

``multiplexed(...)`` turns a loader ``(self, model_id) -> model`` into a
``Multiplexed`` descriptor. Read on a deployment's instance it is that
instance's ``Models``: calling it with a model id gives a ``ModelLease``,
entered by the request handler for the time it uses the model. The models
live in one cache of the replica's broker (``_replica``), keyed by model id;
the cache's releaser is the loader's ``releaser`` (or nothing: the model is
dropped). The broker's events keep ``Models`` told which model ids are
loading and ready, and so what the replica reports to Ray's router.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Awaitable, Callable, Generator, Mapping
from types import TracebackType
from typing import Any, Final, Generic, Protocol, TypeVar, overload

from .. import _log_events as ev
from .._core import State
from .._errors import InvalidArgument
from .._shell import Broker, Cache, Lease
from .._shell._config import non_negative_seconds, positive_seconds
from .._sizes import parse_bytes
from .._stats import Stats
from . import _replica

__all__ = ["ModelLease", "Models", "Multiplexed", "multiplexed"]

T = TypeVar("T")

#: Broker settings a loader may give (``Broker``'s keyword arguments, ``budget`` included).
BROKER_OPTIONS: Final = frozenset(
    {
        "budget",
        "policy",
        "release_timeout",
        "logger",
        "oom_errors",
        "oom_retries",
        "aliases",
        "alias_threshold",
        "sizes",
        "blocking_warning",
        "lease_warning",
        "memory_wait",
        "probe_interval",
    }
)

_UNSET: Any = object()


def _params(func: Callable[..., Any]) -> int:
    try:
        return len(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: trust the caller
        return -1


class Multiplexed(Generic[T]):
    """What ``@multiplexed`` makes of a loader: read on an instance, its ``Models``.

    Called directly (a loader that is a plain function, for a function
    deployment), it is the process's ``Models`` of that loader.
    """

    #: Marks the deployment as multiplexed for Ray Serve, as ``@serve.multiplexed`` does.
    _serve_multiplexed_function: Final = True

    def __init__(
        self,
        func: Callable[..., Any],
        *,
        broker_options: Mapping[str, Any],
        size: Any,
        measure: Callable[[T], Any] | None,
        cost: float | Callable[[str], float] | None,
        timeout: float | None,
        idle_ttl: float | None,
        name: str | None,
    ) -> None:
        if not callable(func):
            raise TypeError(f"@multiplexed decorates a loader function, got {func!r}")
        if _params(func) not in (-1, 1, 2):
            raise TypeError(
                f"@multiplexed loader {func.__qualname__} must take the model id "
                "(a method: self and the model id)"
            )
        if measure is not None and not callable(measure):
            raise TypeError(f"measure must be a callable taking the model, got {measure!r}")
        if (cost is not None and not callable(cost)) and (
            isinstance(cost, bool) or not isinstance(cost, (int, float)) or cost < 0
        ):
            raise InvalidArgument(f"cost must be seconds >= 0 or a callable, got {cost!r}")
        self.func = func
        self.name = name if name is not None else func.__qualname__
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"name must be a non-empty string, got {name!r}")
        self.broker_options = dict(broker_options)
        if size is not None and not callable(size):
            _check_size(size)
        self.size = size
        self.measure = measure
        self.cost = cost
        self.timeout = positive_seconds(timeout, "timeout", inf_is_none=True)
        self.idle_ttl = idle_ttl
        self.release_func: Callable[..., Any] | None = None
        self._attr: str | None = None
        self._bound: weakref.WeakKeyDictionary[object, Models[T]] | None = None
        self._standalone: Models[T] | None = None
        functools.update_wrapper(self, func)

    def releaser(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """Decorate how a model is freed: ``(self, model_id, model)``, async or not.

        The broker calls it, in the replica, when it needs the space or the
        model sat idle; the bytes are counted free once it returns. Without
        one, the model is dropped (its memory goes with its last reference).
        """
        if not callable(func) or _params(func) not in (-1, 2, 3):
            raise TypeError(
                f"a releaser takes the model id and the model (a method: self first), got {func!r}"
            )
        self.release_func = func
        return func

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Multiplexed[T]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> Models[T]: ...
    def __get__(self, instance: object | None, owner: type | None = None) -> Any:
        if instance is None:
            return self
        if self._bound is not None and instance in self._bound:
            return self._bound[instance]
        models = Models(self, instance)
        try:  # later reads find it in the instance, as functools.cached_property does
            if self._attr is None:
                raise AttributeError
            vars(instance)[self._attr] = models
        except (AttributeError, TypeError):
            if self._bound is None:
                self._bound = weakref.WeakKeyDictionary()
            try:
                self._bound[instance] = models
            except TypeError:
                raise TypeError(
                    f"{self.name}: a {type(instance).__name__} has neither a __dict__ nor "
                    "weak references, so it cannot hold its models"
                ) from None
        return models

    def __call__(
        self, model_id: str | None = None, *, timeout: float | None = _UNSET
    ) -> ModelLease[T]:
        """A lease on ``model_id`` (a loader that is a plain function)."""
        if self._standalone is None:
            self._standalone = Models(self, None)
        return self._standalone(model_id, timeout=timeout)

    def __getstate__(self) -> dict[str, Any]:
        # Ray ships the deployment to its replicas: what one process made stays there.
        state = dict(self.__dict__)
        state["_bound"] = None
        state["_standalone"] = None
        return state

    def __repr__(self) -> str:
        return f"<cachebroker.ray.multiplexed {self.name}>"


class Models(Generic[T]):
    """One loader's models in one replica: ``async with models(model_id) as model``."""

    def __init__(self, spec: Multiplexed[T], instance: object | None) -> None:
        self._spec = spec
        self._instance = instance
        self.name = spec.name
        self._replica: _replica.Replica | None = None
        self._cache: Cache | None = None
        self._loading: dict[str, dict[str, int]] = {}  # model id -> bytes reserved
        self._ready: dict[str, dict[str, int]] = {}
        self._asked: dict[str, int] = {}

    def __call__(
        self, model_id: str | None = None, *, timeout: float | None = _UNSET
    ) -> ModelLease[T]:
        """A lease on ``model_id``'s model; by default the request's model id.

        Use as ``async with models(model_id) as model`` for the request's
        duration, or ``lease = await models(model_id)`` then ``await
        lease.release()``. The model is loaded once however many requests ask
        at once, never released while leased, and released by the broker when
        it needs the space. ``timeout`` (seconds) bounds the wait for space and
        the load (``AcquireTimeout``); by default the loader's.
        """
        if timeout is not _UNSET:
            timeout = positive_seconds(timeout, "timeout", inf_is_none=True)
        return ModelLease(self, model_id, timeout)

    # ------------------------------------------------------------ acquiring

    async def _acquire(self, model_id: str | None, timeout: float | None = _UNSET) -> Lease[T]:
        cache = self._cache
        replica = self._replica
        if cache is None or replica is None or replica.closed:
            cache = await self._open()
            replica = self._replica
            assert replica is not None
        if model_id is None:
            model_id = replica.surface.model_id()
            if not model_id:
                raise InvalidArgument(
                    f"{self.name}: this request has no multiplexed model id "
                    "(send it with handle.options(multiplexed_model_id=...) or the "
                    "'serve_multiplexed_model_id' header), and none was given"
                )
        elif not isinstance(model_id, str):
            raise TypeError(f"{self.name}: a model id is a string, got {model_id!r}")
        elif not model_id:
            raise InvalidArgument(f"{self.name}: the model id is empty")
        spec = self._spec
        size = self._call(spec.size, "size", model_id) if callable(spec.size) else spec.size
        cost = self._call(spec.cost, "cost", model_id) if callable(spec.cost) else spec.cost
        new = model_id not in self._ready
        if new:
            self._asked[model_id] = self._asked.get(model_id, 0) + 1
            replica.changed()
        try:
            return await cache.acquire(
                model_id,
                load=self._loader(model_id),
                size=size,
                measure=spec.measure,
                timeout=spec.timeout if timeout is _UNSET else timeout,
                cost=cost,
                idle_ttl=spec.idle_ttl,
            )
        finally:
            if new:
                left = self._asked[model_id] - 1
                if left:
                    self._asked[model_id] = left
                else:
                    del self._asked[model_id]
                replica.changed()

    def _call(self, func: Callable[[str], Any], what: str, model_id: str) -> Any:
        """``func(model_id)``; what it raises says whose callable it was."""
        try:
            return func(model_id)
        except Exception as exc:
            exc.add_note(f"(raised by {self.name}'s {what} callable for model {model_id!r})")
            raise

    async def _open(self) -> Cache:
        replica = _replica.current(
            self._spec.broker_options, self.name, start=self._start_options()
        )
        if replica is not self._replica:
            self._loading.clear()
            self._ready.clear()
        self._replica = replica
        self._cache = cache = await replica.cache(self)
        return cache

    def _start_options(self) -> tuple[Mapping[str, Any], str]:
        """The broker settings to start the replica with, and the loader giving them.

        A replica has one broker, whose settings one loader of the deployment
        may give for all: this loader's, else the first such loader's of its class.
        """
        spec = self._spec
        if not spec.broker_options and self._instance is not None:
            for klass in type(self._instance).__mro__:
                for value in vars(klass).values():
                    if isinstance(value, Multiplexed) and value.broker_options:
                        return value.broker_options, value.name
        return spec.broker_options, self.name

    def _loader(self, model_id: str) -> Callable[[], Any]:
        if self._instance is None:
            return functools.partial(self._spec.func, model_id)
        return functools.partial(self._spec.func, self._instance, model_id)

    async def _release(self, model_id: str, model: T) -> None:
        """The cache's releaser: the loader's ``releaser``, or nothing."""
        func = self._spec.release_func
        if func is None:
            return
        args = (model_id, model) if self._instance is None else (self._instance, model_id, model)
        result = func(*args)
        if inspect.isawaitable(result):
            await result

    # ------------------------------------------------------------ what is held

    def _on_event(self, event: str, fields: Mapping[str, Any]) -> None:
        """Follow this loader's entries through the broker's events."""
        if fields.get("cache") != self.name:
            return
        key = fields.get("key")
        if not isinstance(key, str):
            return
        if event == ev.LOAD_START:
            self._loading[key] = dict(fields.get("bytes") or {})
        elif event in (ev.LOAD_FAILED, ev.LOAD_CANCELLED):  # (told before the books)
            self._loading.pop(key, None)
        elif event in (ev.LOAD_DONE, ev.RELEASE_REQUESTED):  # (told after the books)
            self._settle(key)
        elif event != ev.RELEASE_FREED:  # (freed: the same ids, more free bytes)
            return
        if self._replica is not None:
            self._replica.changed()

    def _settle(self, key: str) -> None:
        """Ready or loading as the books hold ``key`` now, after an event about it.

        The event may be about an entry that no longer holds the key: a
        threaded load whose requesters all left, finishing (and released as
        superfluous) after a newer load of the same key.
        """
        cache = self._cache
        entry = cache._entries.get(key) if cache is not None else None
        state = entry.state if entry is not None else None
        if entry is not None and state is State.READY:
            self._loading.pop(key, None)
            self._ready[key] = dict(entry.charge)
            return
        self._ready.pop(key, None)
        if state is not State.LOADING:
            self._loading.pop(key, None)

    def model_ids(self) -> list[str]:
        """The model ids loaded and ready in this replica, oldest load first."""
        return list(self._ready)

    def _ready_charges(self) -> list[Mapping[str, int]]:
        return list(self._ready.values())

    def _sizes(self) -> dict[str, dict[str, int]]:
        """The bytes of each model held or loading (as reserved), for the router."""
        return {**self._loading, **{key: dict(charge) for key, charge in self._ready.items()}}

    def _waiting_ids(self) -> list[str]:
        """Model ids loading, or asked for by a request and not ready yet."""
        ids = dict.fromkeys(self._loading)
        ids.update((key, None) for key in self._asked if key not in self._ready)
        return list(ids)

    def _reported(self) -> list[str]:
        """What Ray's router is told: ready, loading and asked-for model ids."""
        return list(dict.fromkeys([*self._ready, *self._waiting_ids()]))

    async def broker(self) -> Broker:
        """The replica's broker, started if it was not.

        Cancellation: stops the wait; a start under way goes on.
        """
        if self._replica is None or self._replica.closed:
            await self._open()
        assert self._replica is not None
        return await self._replica.broker()

    async def stats(self) -> Stats:
        """``stats()`` of the replica's broker.

        Cancellation: nothing to undo.
        """
        return await (await self.broker()).stats()

    def __repr__(self) -> str:
        return f"<cachebroker.ray.Models {self.name} ready={self.model_ids()!r}>"


class ModelLease(Generic[T]):
    """A request's lease on one model: ``async with`` gives the model, ``await`` the ``Lease``."""

    __slots__ = ("_lease", "_model_id", "_models", "_timeout")

    def __init__(self, models: Models[T], model_id: str | None, timeout: float | None) -> None:
        self._models = models
        self._model_id = model_id
        self._timeout = timeout
        self._lease: Lease[T] | None = None

    async def __aenter__(self) -> T:
        """Lease the model, loading it first if needed; the block gets the model.

        Raises what ``Cache.acquire`` raises (``AcquireTimeout``,
        ``RequestTooLarge``, the loader's exception, ...), ``InvalidArgument``
        for a missing model id, ``BrokerClosed`` when the replica's broker
        could not start. Cancellation: withdraws this request only (a load
        other requests wait for goes on).
        """
        if self._lease is not None:
            raise RuntimeError("a ModelLease can be entered once")
        self._lease = await self._models._acquire(self._model_id, self._timeout)
        return self._lease.value

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """End the lease (one synchronous step: cancellation cannot stop it)."""
        if self._lease is not None:
            await self._lease.release()

    def __await__(self) -> Generator[Any, None, Lease[T]]:
        return self._models._acquire(self._model_id, self._timeout).__await__()


class _Decorator(Protocol):
    """What ``multiplexed(...)`` with settings returns: a decorator of loaders."""

    @overload
    def __call__(self, func: Callable[..., Awaitable[T]], /) -> Multiplexed[T]: ...
    @overload
    def __call__(self, func: Callable[..., T], /) -> Multiplexed[T]: ...


@overload
def multiplexed(func: Callable[..., Awaitable[T]], /) -> Multiplexed[T]: ...
@overload
def multiplexed(func: Callable[..., T], /) -> Multiplexed[T]: ...
@overload
def multiplexed(
    *,
    size: Any = None,
    measure: Callable[[Any], Any] | None = None,
    cost: float | Callable[[str], float] | None = None,
    timeout: float | None = None,
    idle_ttl: float | None = None,
    name: str | None = None,
    **broker_options: Any,
) -> _Decorator: ...
def multiplexed(
    func: Callable[..., Any] | None = None,
    /,
    *,
    size: Any = None,
    measure: Callable[[Any], Any] | None = None,
    cost: float | Callable[[str], float] | None = None,
    timeout: float | None = None,
    idle_ttl: float | None = None,
    name: str | None = None,
    **broker_options: Any,
) -> Any:
    """Make a model loader's models a broker's: the ``@serve.multiplexed`` of byte budgets.

    ::

        @serve.deployment(num_replicas=2)
        class Models:
            @multiplexed(budget="8GiB", size=model_bytes)
            async def get_model(self, model_id: str) -> Model:
                return await load(model_id)

            async def __call__(self, request):
                async with self.get_model(serve.get_multiplexed_model_id()) as model:
                    return await model(request)

    Args:
        func: The loader, ``(self, model_id)`` or ``(model_id)``; async, or
            plain (it then runs in a worker thread).
        size: What a model takes, reserved before its load: bytes, ``"3GiB"``
            or ``{"cuda:0": "3GiB", "ram": ...}``, or a callable taking the
            model id and returning one of those. ``None``: only ``measure``.
        measure: A callable taking the loaded model and returning its real
            size; it corrects the books and is remembered per model id.
        cost: Reload cost in seconds for cost-aware policies, or a callable of
            the model id; by default the measured load time.
        timeout: Default seconds a request waits for space and the load.
        idle_ttl: Seconds an unleased model may stay idle before it is released.
        name: The cache's name in the broker (default: the loader's qualified name).
        **broker_options: The replica's broker: ``budget`` and ``Broker``'s
            keyword arguments (``policy``, ``release_timeout``, ...). A budget
            may be a callable returning one, called in the replica (for
            probes: ``budget=lambda: {"cuda:0": NvidiaGPU(0)}``). Ignored
            where ``CACHEBROKER_ADDRESS`` is set: the replica then uses the
            machine's shared broker and its budget.

    Raises:
        TypeError, InvalidArgument: at decoration, for a bad argument.
    """
    unknown = sorted(set(broker_options) - BROKER_OPTIONS)
    if unknown:
        raise TypeError(
            f"@multiplexed got unknown arguments {', '.join(unknown)}; broker settings are "
            f"{', '.join(sorted(BROKER_OPTIONS))}"
        )
    _check_broker_options(broker_options)
    if idle_ttl is not None:
        non_negative_seconds(idle_ttl, "idle_ttl", allow_inf=True)

    def decorate(loader: Callable[..., Any]) -> Multiplexed[Any]:
        return Multiplexed(
            loader,
            broker_options=broker_options,
            size=size,
            measure=measure,
            cost=cost,
            timeout=timeout,
            idle_ttl=idle_ttl,
            name=name,
        )

    if func is not None:
        return decorate(func)
    return decorate


def _check_size(size: object) -> None:
    """A fixed ``size``'s quantities, checked (its spaces are the budget's: checked at use)."""
    if isinstance(size, Mapping):
        for space, amount in size.items():
            if not isinstance(space, str) or not space:
                raise InvalidArgument(f"size: a space is a non-empty string, got {space!r}")
            parse_bytes(amount, what=f"size[{space!r}]")
    else:
        parse_bytes(size, what="size")


def _check_broker_options(options: Mapping[str, Any]) -> None:
    """Build a throwaway broker from ``options`` so that a bad one fails at decoration."""
    settings = dict(options)
    budget = settings.pop("budget", None)
    if budget is None or callable(budget):
        budget = 1  # (checked in the replica, where it is known)
    Broker(budget, **settings)
