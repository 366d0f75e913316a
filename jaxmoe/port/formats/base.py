"""The checkpoint-format protocol: :class:`Format` (one per scheme), :class:`Source`, :class:`Sink`.

A checkpoint on the command line is an :class:`Endpoint`, ``SCHEME:PATH`` (plus what the format's
syntax adds, e.g. ``orbax:DIR@STEP``), whose format is a row of the table in
:mod:`jaxmoe.port.formats`. Everything that moves or runs weights (``jaxmoe convert``,
``train --init-from``, ``jaxmoe logits``, ``convert --verify``) talks to a checkpoint only through
this protocol:

* a :class:`Source` gives jaxmoe leaves (canonical names ``params/...`` / ``buffers/...``, see
  :mod:`jaxmoe.port.maps.hf_map`) one at a time with their shapes and dtypes, the model config, and
  what a format may carry besides weights (HF non-weight files, the files a content fingerprint
  covers, files PyTorch loaders read as they are);
* a :class:`Sink` takes leaves one at a time and completes the checkpoint in a temporary folder;
  :func:`jaxmoe.port.commands.convert.convert` renames it into place, so a destination is either complete
  or untouched;
* a :class:`Format` class names the scheme, its syntax and help, its :class:`Option` flags and
  its capabilities (``can_write``, ``verify_frameworks``, ``default_dtype``), and opens the two.

A format that keeps its own tensor names (not HF's) maps them to jaxmoe leaves inside its Source;
one that needs a model config from outside the checkpoint declares an :class:`Option` (role
``source``) whose value arrives in ``Endpoint.options``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from jaxmoe.config import Config
from jaxmoe.errors import UserError


def shape_text(shape) -> str:
    """``[2, 3]``: a shape as messages print it."""
    return "[" + ", ".join(str(int(x)) for x in shape) + "]"


@dataclass(frozen=True)
class Option:
    """A command-line flag of one format (``--hf-layout``), passed as keyword ``name``.

    ``role`` says which endpoint takes it: ``"source"`` (read) or ``"sink"`` (written).
    ``parse`` turns the given value into the stored one (raising a one-line UserError);
    ``choices`` are checked first. With ``report`` the value a sink used (``default`` when not
    given) is a field of ``convert``'s figures, None for destinations of other formats."""

    name: str
    flag: str
    role: str
    help: str
    choices: tuple | None = None
    parse: Callable[[Any], Any] | None = None
    default: Any = None
    report: bool = False
    takes_value: bool = True  # False: a switch (``--with-optimizer``), True when given

    def value(self, given):
        if not self.takes_value:
            return bool(given)
        if self.choices is not None and given not in self.choices:
            raise UserError(f"{self.flag} {given!r}: choose one of {', '.join(self.choices)}")
        return self.parse(given) if self.parse is not None else given


#: the model of a checkpoint that holds no config (``dcp:``; an ``hf:`` folder without
#: config.json, as torchtitan's HF export writes): :func:`jaxmoe.config.named_config`
TITAN_OPTION = Option(
    "titan", "--titan", "source",
    help="the model of a dcp: checkpoint (which holds no config) or of an hf: folder without "
         "config.json (torchtitan's HF export): a torchtitan FAMILY/FLAVOR, e.g. "
         "deepseek_v3/debugmodel (needs the [titan] extra), or a jaxmoe preset / config .toml")


@dataclass(frozen=True)
class Endpoint:
    """A checkpoint location: its format, path and format options (syntax and flag values)."""

    format: type[Format]
    path: Path
    options: dict = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return self.format.scheme

    def with_options(self, **values) -> Endpoint:
        return dataclasses.replace(self, options={**self.options, **values})

    def __str__(self) -> str:
        return self.format.text(self)


class Source:
    """A checkpoint read one jaxmoe leaf at a time (numpy arrays).

    Opening one reads its config and checks every tensor header against the mapping built from
    it (a one-line UserError otherwise); tensors are read only by :meth:`read_leaf` and friends.
    Subclasses set ``ep``, ``cfg``, ``shapes`` (leaf -> shape) and ``notices`` and implement
    :meth:`leaf_dtype`, :meth:`read_leaf`, :meth:`read_rows`, :meth:`content_files`.
    """

    ep: Endpoint
    cfg: Config
    shapes: dict[str, tuple]
    notices: list[str]

    def keys(self) -> list[str]:
        """The leaves, in the order a conversion reads them."""
        return list(self.shapes)

    def leaf_dtype(self, key: str) -> np.dtype:
        """The dtype leaf ``key`` has when read without a ``dtype``."""
        raise NotImplementedError

    def read_leaf(self, key: str, dtype=None, out: np.ndarray | None = None) -> np.ndarray:
        """Leaf ``key`` as an array of ``dtype`` (default :meth:`leaf_dtype`), into ``out``
        (the leaf's shape and dtype) when given."""
        raise NotImplementedError

    def leaf_view(self, key: str, dtype=None):
        """Leaf ``key`` as an array-like whose ``[index]`` (integer tuples over the leading axes)
        gives one layer's / expert's slice; a format may read those slices lazily."""
        return self.read_leaf(key, dtype)

    def read_rows(self, key: str, n: int, dtype=None) -> np.ndarray:
        """The first ``n`` rows of a layer-stack leaf (all of a global leaf), reading no more
        than those (``--verify-layers``: a truncated model of a checkpoint of any size)."""
        raise NotImplementedError

    @property
    def spec(self) -> str:
        """The endpoint text that re-opens exactly what was read (absolute path, pinned step)."""
        return str(dataclasses.replace(self.ep, path=self.ep.path.absolute()))

    @property
    def meta_dir(self) -> Path | None:
        """Where the checkpoint keeps non-weight HF files (tokenizer, generation config, the
        original config.json; see :mod:`jaxmoe.port.io.hf_meta`), or None."""
        return None

    def content_files(self) -> list[Path]:
        """The files holding the weights and config (what a content fingerprint covers)."""
        raise NotImplementedError

    @property
    def hub_files(self) -> dict[str, Path] | None:
        """HF tensor name -> file, when the checkpoint's tensors carry the per-expert hub names
        a PyTorch loader (torch_ref) reads without jaxmoe's mapping; None otherwise."""
        return None

    @property
    def hf_dir(self) -> Path | None:
        """The folder, when the checkpoint is one that ``transformers.from_pretrained`` reads
        as it is; None otherwise."""
        return None

    #: the naming :meth:`raw_tensors` uses (``"hf"``: hub tensor names), or None: none
    raw_names: ClassVar[str | None] = None

    def raw_tensors(self, key: str) -> dict[str, RawTensor] | None:
        """Where leaf ``key``'s tensors lie as plain bytes in files, by tensor name in the
        :attr:`raw_names` naming, when the leaf is exactly those tensors unchanged (no cast,
        no dequantisation); None otherwise. A sink with the same naming that stores the same
        bytes, or one of another naming whose tensors carry their leaf ``index`` too, then gets
        them copied file to file (:func:`jaxmoe.port.commands.convert.raw_copies`)."""
        return None

    _ahead = None  # the source's ReadAhead, made on first use (read_ahead)

    def read_ahead(self):
        """The :class:`~jaxmoe.storage.direct_io.ReadAhead` a lazy leaf view reads its blocks of
        expert rows with (one per source, shared by its views; closed by :meth:`close`)."""
        if self._ahead is None:
            from jaxmoe.storage.direct_io import ReadAhead

            self._ahead = ReadAhead()
        return self._ahead

    def close(self) -> None:
        """Release what the source holds open (subclasses call this too)."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class RawTensor:
    """One tensor stored as plain little-endian C-order bytes: ``nbytes`` at ``offset`` of
    ``file``, of ``dtype`` and ``shape`` (a safetensors tensor, say).

    ``index`` (when known) is the tensor's place in its jaxmoe leaf -- it is ``leaf[index]``,
    with its last two dims swapped when ``transpose`` -- so tensors of two namings can still be
    matched byte range to byte range (``hf:`` per-expert ``[F, D]`` tensors are the rows of a
    torchtitan ``[E, F, D]`` one): :func:`jaxmoe.port.commands.convert.raw_copies`."""

    file: Path
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    index: tuple[int, ...] | None = None
    transpose: bool = False


class Sink:
    """A checkpoint being written into ``target`` (a temporary folder next to the destination),
    one leaf at a time: :meth:`write_leaf` for each of the source's leaves, then :meth:`finish`,
    then :meth:`carry` with the source's non-weight files. ``tensors`` is the number of tensors
    the written checkpoint holds as convert reports it (HF tensors of the model)."""

    tensors: int = 0
    #: ``write_leaf`` only takes ``arr[index]`` slices over the leading axes, so a lazy
    #: :meth:`Source.leaf_view` will do (the whole leaf is never needed at once)
    takes_views: bool = False

    def buffer(self, key: str, shape, dtype) -> np.ndarray | None:
        """An array for the source to read leaf ``key`` into (then pass it to
        :meth:`write_leaf`), or None when the sink takes any array."""
        return None

    #: the naming :meth:`raw_tensors` uses (see :attr:`Source.raw_names`), or None
    raw_names: ClassVar[str | None] = None

    def raw_tensors(self, key: str) -> dict[str, RawTensor] | None:
        """Where leaf ``key``'s tensors go as plain bytes (pre-sized files, or ranges the sink
        fills around afterwards), by tensor name, when the sink stores them unchanged; None
        otherwise. Asking writes nothing; :meth:`raw_written` is called once the bytes are
        there instead of :meth:`write_leaf` (a sink that is asked and not told keeps no trace)."""
        return None

    #: where :meth:`raw_tensors` places a leaf does not depend on what was written before, so
    #: ``convert`` may gather the copies of consecutive leaves and run them in the order of the
    #: destination's bytes: one pass over each file, not one strided pass per leaf (an HF file
    #: interleaves gate / up / down per expert). False: placed at the current end (``dcp:``)
    raw_any_order = False

    #: the sink wants the CRC-32 of each byte range copied for it (computed while the bytes are
    #: still in the page cache), passed to :meth:`raw_written`
    wants_crc = False

    def raw_written(self, key: str, crcs: list | None = None) -> None:
        """Leaf ``key``'s tensors were copied into place as :meth:`raw_tensors` said; ``crcs``
        (when :attr:`wants_crc`): ``(RawTensor range written, its CRC-32)`` per copy."""
        raise NotImplementedError

    def write_leaf(self, key: str, arr) -> None:
        raise NotImplementedError

    def use_source(self, source) -> None:
        """Called once before the first leaf with the opened source, for what a sink writes
        besides weights (the ``dcp:`` sink's ``--with-optimizer`` training state); may refuse
        the source with one line. (Default: nothing.)"""

    def finish(self) -> None:
        """Write what is still pending: ``target`` then holds the complete checkpoint."""

    def carry(self, files: list[Path], log=None) -> list[str]:
        """Keep the source's non-weight HF files with the written checkpoint; the names kept.
        (Default: the format has no place for them.)"""
        return []


class Format:
    """One checkpoint format: a row of :data:`jaxmoe.port.formats.FORMATS`.

    Class attributes describe it; classmethods parse its endpoints and open its two sides."""

    scheme: ClassVar[str]
    #: ``hf:DIR``: what ``--from`` / ``--to`` / ``--ckpt`` take, as help and errors print it
    syntax: ClassVar[str]
    help: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    #: a Sink exists (``convert --to`` this format)
    can_write: ClassVar[bool] = True
    #: the frameworks that run this format with their own loader, preferred first while its
    #: packages are installed (``jax``: jaxmoe's own format; ``hf``: transformers; ``torch``:
    #: torch_ref); ``convert --verify`` runs the side not read through jaxmoe's mapping in one
    verify_frameworks: ClassVar[tuple[str, ...]] = ("jax",)
    #: a destination holds only models their HF architecture expresses (``convert`` checks
    #: ``model.hf_arch`` before reading); False for jaxmoe's own run dirs
    hf_arch_only: ClassVar[bool] = True
    #: the dtype leaves are written in without ``--dtype`` (None: the source's)
    default_dtype: ClassVar[np.dtype | None] = None
    #: what :meth:`is_output` recognises, for ``--force``'s refusal
    output_what: ClassVar[str] = ""

    @classmethod
    def parse(cls, text: str, rest: str, flag: str) -> Endpoint:
        """The endpoint of ``text`` (``rest``: what follows ``SCHEME:``)."""
        return Endpoint(cls, Path(rest))

    @classmethod
    def text(cls, ep: Endpoint) -> str:
        return f"{cls.scheme}:{ep.path}"

    @classmethod
    def open_source(cls, ep: Endpoint) -> Source:
        raise NotImplementedError

    @classmethod
    def check_sink(cls, ep: Endpoint) -> None:
        """Raise UserError when ``ep`` cannot be written (before anything is)."""
        if not cls.can_write:
            raise UserError(f"{ep}: {cls.scheme}: checkpoints are read, not written; "
                            "write --to another format")

    @classmethod
    def open_sink(cls, ep: Endpoint, target: Path, cfg: Config, dtypes: dict, log) -> Sink:
        """A sink writing ``cfg``'s leaves in ``dtypes`` (leaf -> dtype) into ``target``, a
        path inside a temporary folder next to ``ep.path`` (which it may use for scratch)."""
        raise NotImplementedError

    @classmethod
    def is_output(cls, path: Path) -> bool:
        """``path`` looks like what a conversion to this format wrote (``--force`` replaces
        only those)."""
        return False


__all__ = ["TITAN_OPTION", "Endpoint", "Format", "Option", "RawTensor", "Sink", "Source",
           "shape_text"]
