//! Mapping of core errors to the Python exception classes of `pagedkv.errors`.
//!
//! Owns the one place where a [`pagedkv::Error`] becomes a Python exception. Each variant raises its
//! own class, constructed as `cls(message, **fields)`: the message is the core's `Display` text
//! verbatim and the variant's fields become attributes. The classes are looked up once, on the first
//! error, and cached for the life of the interpreter; importing `pagedkv.errors` at module init
//! instead would make `import pagedkv._core` fail whenever the package layout is off, which is a
//! worse failure than a degraded error.
//!
//! Binding-side validation (an id out of range, a value of the wrong type) raises
//! `InvalidArgumentError` through [`invalid_arg`], with the same message shape as the core's
//! `InvalidArgument` so callers cannot tell where a check ran.

use pagedkv::Error;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};
use pyo3::BoundObject;

/// The exception classes, in the order of [`CLASS_NAMES`].
struct Classes([Py<PyType>; CLASS_NAMES.len()]);

const CLASS_NAMES: [&str; 15] = [
    "InvalidConfigError",
    "InvalidArgumentError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "OutOfBlocksError",
    "WatermarkReachedError",
    "SequenceTooLongError",
    "BufferTooSmallError",
    "BufferInvalidError",
    "BuffersNotRegisteredError",
    "InvalidBlockError",
    "RefcountUnderflowError",
    "PrefixCollisionError",
    "InvariantViolationError",
    "AllocationFailedError",
];

const INVALID_ARGUMENT: usize = 1;

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

fn classes(py: Python<'_>) -> PyResult<&'static Classes> {
    CLASSES.get_or_try_init(py, || {
        let module = py.import("pagedkv.errors")?;
        let mut out = Vec::with_capacity(CLASS_NAMES.len());
        for name in CLASS_NAMES {
            out.push(module.getattr(name)?.cast_into::<PyType>()?.unbind());
        }
        let arr: [Py<PyType>; CLASS_NAMES.len()] = out
            .try_into()
            .unwrap_or_else(|_| unreachable!("one class per name"));
        Ok(Classes(arr))
    })
}

/// Builds `cls(message, **fields)`; falls back to `RuntimeError` if `pagedkv.errors` is unusable.
fn raise(
    py: Python<'_>,
    index: usize,
    message: String,
    fields: &[(&str, Bound<'_, PyAny>)],
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let cls = classes(py)?.0[index].bind(py);
        let kwargs = PyDict::new(py);
        for (k, v) in fields {
            kwargs.set_item(*k, v)?;
        }
        Ok(PyErr::from_value(
            cls.call((message.as_str(),), Some(&kwargs))?,
        ))
    };
    match build() {
        Ok(err) => err,
        Err(cause) => PyRuntimeError::new_err(format!(
            "{message} (pagedkv.errors could not be used: {cause})"
        )),
    }
}

fn obj<'py, T: IntoPyObject<'py>>(py: Python<'py>, v: T) -> Bound<'py, PyAny> {
    match v.into_pyobject(py) {
        Ok(b) => b.into_any().into_bound(),
        // Plain ints and strings cannot fail to convert; None keeps the error path total anyway.
        Err(_) => py.None().into_bound(py),
    }
}

/// Converts a core error into the matching `pagedkv.errors` exception.
pub fn core_err(e: Error) -> PyErr {
    Python::attach(|py| core_err_py(py, e))
}

fn core_err_py(py: Python<'_>, e: Error) -> PyErr {
    let message = e.to_string();
    match e {
        Error::InvalidConfig {
            field,
            value,
            reason,
        } => raise(
            py,
            0,
            message,
            &[
                ("field", obj(py, field)),
                ("value", obj(py, value)),
                ("reason", obj(py, reason)),
            ],
        ),
        Error::InvalidArgument {
            what,
            value,
            reason,
        } => raise(
            py,
            INVALID_ARGUMENT,
            message,
            &[
                ("what", obj(py, what)),
                ("value", obj(py, value)),
                ("reason", obj(py, reason)),
            ],
        ),
        Error::UnknownSequence { seq_id } => raise(py, 2, message, &[("seq_id", obj(py, seq_id))]),
        Error::DuplicateSequence { seq_id } => {
            raise(py, 3, message, &[("seq_id", obj(py, seq_id))])
        }
        Error::OutOfBlocks { needed, available } => raise(
            py,
            4,
            message,
            &[
                ("needed", obj(py, needed)),
                ("available", obj(py, available)),
            ],
        ),
        Error::WatermarkReached {
            needed,
            available,
            watermark,
        } => raise(
            py,
            5,
            message,
            &[
                ("needed", obj(py, needed)),
                ("available", obj(py, available)),
                ("watermark", obj(py, watermark)),
            ],
        ),
        Error::SequenceTooLong {
            seq_id,
            needed_blocks,
            max_blocks_per_seq,
        } => raise(
            py,
            6,
            message,
            &[
                ("seq_id", obj(py, seq_id)),
                ("needed_blocks", obj(py, needed_blocks)),
                ("max_blocks_per_seq", obj(py, max_blocks_per_seq)),
            ],
        ),
        Error::BufferTooSmall {
            buffer,
            needed,
            capacity,
        } => raise(
            py,
            7,
            message,
            &[
                ("buffer", obj(py, buffer)),
                ("needed", obj(py, needed)),
                ("capacity", obj(py, capacity)),
            ],
        ),
        Error::BufferInvalid {
            buffer,
            expected,
            got,
        } => raise(
            py,
            8,
            message,
            &[
                ("buffer", obj(py, buffer)),
                ("expected", obj(py, expected)),
                ("got", obj(py, got)),
            ],
        ),
        Error::BuffersNotRegistered => raise(py, 9, message, &[]),
        Error::InvalidBlock { block, num_blocks } => raise(
            py,
            10,
            message,
            &[
                ("block", obj(py, block)),
                ("num_blocks", obj(py, num_blocks)),
            ],
        ),
        Error::RefcountUnderflow { block } => raise(py, 11, message, &[("block", obj(py, block))]),
        Error::PrefixCollision { block } => raise(py, 12, message, &[("block", obj(py, block))]),
        Error::InvariantViolation(detail) => raise(py, 13, message, &[("detail", obj(py, detail))]),
        Error::AllocationFailed { what, bytes } => raise(
            py,
            14,
            message,
            &[("what", obj(py, what)), ("bytes", obj(py, bytes))],
        ),
    }
}

/// Extension for `Result<T, pagedkv::Error>`: `.py()?` raises the mapped Python exception.
pub trait CoreResultExt<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> CoreResultExt<T> for pagedkv::Result<T> {
    #[inline]
    fn py(self) -> PyResult<T> {
        self.map_err(core_err)
    }
}

/// `InvalidArgumentError` raised by the binding's own checks; `value` is kept as the Python object
/// the caller passed (an int of any size, or whatever was there instead of one).
pub fn invalid_arg(what: &str, value: &Bound<'_, PyAny>, reason: impl Into<String>) -> PyErr {
    let py = value.py();
    let reason = reason.into();
    let shown = value
        .str()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "?".into());
    let message = format!("invalid argument: {what} = {shown}: {reason}");
    raise(
        py,
        INVALID_ARGUMENT,
        message,
        &[
            ("what", obj(py, what)),
            ("value", value.clone()),
            ("reason", obj(py, reason)),
        ],
    )
}

/// [`invalid_arg`] for a value the binding holds as a Rust integer.
pub fn invalid_arg_int(
    py: Python<'_>,
    what: &str,
    value: i128,
    reason: impl Into<String>,
) -> PyErr {
    invalid_arg(what, &obj(py, value), reason)
}

static ALLOCATION_FAILED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `AllocationFailedError(message, what=, bytes=)`: the binding could not allocate `bytes` bytes
/// for `what`. Falls back to `MemoryError` if `pagedkv.errors` is unusable.
pub fn alloc_failed(py: Python<'_>, what: &str, bytes: u128) -> PyErr {
    let message = format!("allocation failed: {what} needs {bytes} bytes");
    let build = || -> PyResult<PyErr> {
        let cls = ALLOCATION_FAILED.get_or_try_init(py, || {
            Ok::<_, PyErr>(
                py.import("pagedkv.errors")?
                    .getattr("AllocationFailedError")?
                    .cast_into::<PyType>()?
                    .unbind(),
            )
        })?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("what", what)?;
        kwargs.set_item("bytes", bytes)?;
        Ok(PyErr::from_value(
            cls.bind(py).call((message.as_str(),), Some(&kwargs))?,
        ))
    };
    build().unwrap_or_else(|cause| {
        PyMemoryError::new_err(format!(
            "{message} (pagedkv.errors could not be used: {cause})"
        ))
    })
}

/// Builds a sample of every core variant; lets tests check the mapping of variants that no public
/// call can reach (the pool's refcount errors, a hash collision).
pub fn sample(name: &str) -> Option<Error> {
    Some(match name {
        "InvalidConfig" => Error::InvalidConfig {
            field: "block_size",
            value: 0,
            reason: "must be at least 1".into(),
        },
        "InvalidArgument" => Error::InvalidArgument {
            what: "num_tokens",
            value: -1,
            reason: "must not be negative".into(),
        },
        "UnknownSequence" => Error::UnknownSequence { seq_id: 7 },
        "DuplicateSequence" => Error::DuplicateSequence { seq_id: 7 },
        "OutOfBlocks" => Error::OutOfBlocks {
            needed: 3,
            available: 1,
        },
        "WatermarkReached" => Error::WatermarkReached {
            needed: 3,
            available: 1,
            watermark: 2,
        },
        "SequenceTooLong" => Error::SequenceTooLong {
            seq_id: 7,
            needed_blocks: 9,
            max_blocks_per_seq: 8,
        },
        "BufferTooSmall" => Error::BufferTooSmall {
            buffer: "slot_mapping",
            needed: 9,
            capacity: 8,
        },
        "BufferInvalid" => Error::BufferInvalid {
            buffer: "seq_lens",
            expected: "int32",
            got: "int64".into(),
        },
        "BuffersNotRegistered" => Error::BuffersNotRegistered,
        "InvalidBlock" => Error::InvalidBlock {
            block: 12,
            num_blocks: 10,
        },
        "RefcountUnderflow" => Error::RefcountUnderflow { block: 3 },
        "PrefixCollision" => Error::PrefixCollision { block: 4 },
        "InvariantViolation" => Error::InvariantViolation("free list holds block 2 twice".into()),
        "AllocationFailed" => Error::AllocationFailed {
            what: "prefix hash map",
            bytes: 1 << 40,
        },
        _ => return None,
    })
}
