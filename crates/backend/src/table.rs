//! The machinery that turns the seam's one table (`ops.rs`) into code. The table lists, per group trait,
//! its [`crate::Op`]s and, per op, the methods it covers; `seam!` generates from it:
//! - the group traits themselves (`MemoryOps`, `CoreOps`, …), methods and contract docs as written;
//! - [`crate::Op`], [`crate::Op::ALL`], and each op's group and method names (for `supports` and errors);
//! - [`crate::Wrapper`]: a backend around another one, every method forwarding to `inner()` unless the
//!   wrapper overrides it, with blanket impls of every group trait and [`crate::Backend`] for any wrapper.
//!   The host-fallback, counting and deferred-fence test backends are wrappers: they write only the
//!   methods they watch or replace.
//!
//! So adding an op is one table entry plus its implementation in each backend (the compiler lists the
//! backends that lack it); nothing else repeats a signature. This is ggml-backend's shape (a small
//! interface, one op table) in Rust's terms: traits a backend author implements group by group.
//!
//! A group is `trait Name { … }`, or `trait Name: Other { … }` when its default bodies call another
//! group's methods. A table entry is `fn name(&self, arg: Type, …) -> Ret;`; for a method with a default body that a
//! backend may replace (a fused kernel, an asynchronous copy), `fn name(&self, …) -> Ret = { body };`,
//! which a wrapper forwards like any other; for a convenience composed of other methods and never
//! replaced, `fn name(&self, …) -> Ret = @derived { body };`, which a wrapper does not forward, so it
//! runs through the wrapper's own overrides (a counting wrapper's `upload` sees `upload_f32`'s call).
//! Arguments are plain names (no patterns), no trailing comma.

/// One trait method: required (no body) or provided (with its default body).
macro_rules! seam_fn {
    (($($sig:tt)*) ()) => {
        $($sig)*;
    };
    (($($sig:tt)*) ($body:block)) => {
        $($sig)* $body
    };
}

/// Emits its items unless marked `[derived]` (a convenience composed of other methods, which a wrapper
/// must not forward: its overrides of those methods would be bypassed).
macro_rules! seam_unless_derived {
    ([derived] $($item:tt)*) => {};
    ([] $($item:tt)*) => {
        $($item)*
    };
}

/// The generator; see the module docs. Invoked once, in `ops.rs`.
macro_rules! seam {
    (
        $(#[$bm:meta])*
        backend;
        $(
            $(#[$tm:meta])*
            trait $Trait:ident $(: $Super:ident)? {
                $(
                    $(#[$om:meta])*
                    op $Op:ident {
                        $(
                            $(#[$fm:meta])*
                            fn $name:ident(&$self:tt $(, $arg:ident : $ty:ty)*) $(-> $ret:ty)? $(= $(@$kind:ident)? $body:block)?;
                        )*
                    }
                )*
            }
        )*
    ) => {
        $(
            $(#[$tm])*
            pub trait $Trait $(: $Super)? {
                $($(
                    seam_fn! { ($(#[$fm])* fn $name(&$self $(, $arg: $ty)*) $(-> $ret)?) ($($body)?) }
                )*)*
            }
        )*

        $(#[$bm])*
        pub trait Backend: $($Trait +)* Send + Sync + std::fmt::Debug {
            /// Its device.
            fn device(&self) -> Device;

            /// One line for the startup log (device, kernels chosen).
            fn describe(&self) -> String;

            /// Whether this backend runs `op` on its device (model families check theirs at load).
            fn supports(&self, op: Op) -> bool;

            /// Device memory and traffic since start, for `/metrics` (the CPU reports none).
            fn stats(&self) -> DeviceStats {
                DeviceStats::default()
            }

            /// The device's sticky fault, if it has one ([`crate::BackendError::Fault`]): the engine asks
            /// after each step and stops, since nothing computed on the device can be trusted after it.
            fn health(&self) -> Result<()> {
                Ok(())
            }

            /// The work from here to the next host wait (or [`Backend::end_step`]) is a decode step of
            /// shape `key` (its sequences' count): a backend that replays graphs records such a step the
            /// first time and replays it after ([`DeviceStats::graphs`]); the results are the same.
            fn begin_step(&self, key: u64) -> Result<()> {
                let _ = key;
                Ok(())
            }

            /// Ends the step [`Backend::begin_step`] began: its graph, if one is pending, runs.
            fn end_step(&self) -> Result<()> {
                Ok(())
            }
        }

        /// An op group of the set, for [`Backend::supports`]: a backend in progress (a device backend
        /// gaining its kernels one by one) answers which it runs, and a model family lists the ops it
        /// needs, so loading refuses a backend that lacks one with a clear error instead of running a
        /// host fallback slowly. Generated from the table in `ops.rs`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Op {
            $($(
                $(#[$om])*
                $Op,
            )*)*
        }

        impl Op {
            /// Every op, in table order.
            pub const ALL: &'static [Op] = &[$($(Op::$Op,)*)*];

            /// The group trait that declares the op's methods.
            pub fn group(self) -> &'static str {
                match self {
                    $($(Op::$Op => stringify!($Trait),)*)*
                }
            }

            /// The trait methods the op covers (an op with none, such as `LinearNvfp4`, qualifies
            /// another op's method by weight type).
            pub fn methods(self) -> &'static [&'static str] {
                match self {
                    $($(Op::$Op => &[$(stringify!($name)),*],)*)*
                }
            }
        }

        /// A backend around `inner()`: every method forwards to it unless the wrapper overrides it.
        /// Implement this (never the group traits) for a test or adapter backend; the blanket impls
        /// make it a [`Backend`]. Inside an override, call the inner backend through `self.inner()`
        /// (a wrapper's own `self.op(…)` names both this trait's method and the group's).
        pub trait Wrapper: Send + Sync + std::fmt::Debug {
            /// The wrapped backend.
            fn inner(&self) -> &dyn Backend;

            /// [`Backend::device`].
            fn device(&self) -> Device {
                self.inner().device()
            }

            /// [`Backend::describe`].
            fn describe(&self) -> String {
                self.inner().describe()
            }

            /// [`Backend::supports`].
            fn supports(&self, op: Op) -> bool {
                self.inner().supports(op)
            }

            /// [`Backend::stats`].
            fn stats(&self) -> DeviceStats {
                self.inner().stats()
            }

            /// [`Backend::health`].
            fn health(&self) -> Result<()> {
                self.inner().health()
            }

            /// [`Backend::begin_step`].
            fn begin_step(&self, key: u64) -> Result<()> {
                self.inner().begin_step(key)
            }

            /// [`Backend::end_step`].
            fn end_step(&self) -> Result<()> {
                self.inner().end_step()
            }

            $($($(
                seam_unless_derived! { [$($($kind)?)?]
                    $(#[$fm])*
                    fn $name(&$self $(, $arg: $ty)*) $(-> $ret)? {
                        $self.inner().$name($($arg),*)
                    }
                }
            )*)*)*
        }

        $(
            impl<W: Wrapper> $Trait for W {
                $($(
                    seam_unless_derived! { [$($($kind)?)?]
                        #[allow(clippy::too_many_arguments)]
                        fn $name(&$self $(, $arg: $ty)*) $(-> $ret)? {
                            <W as Wrapper>::$name($self $(, $arg)*)
                        }
                    }
                )*)*
            }
        )*

        impl<W: Wrapper> Backend for W {
            fn device(&self) -> Device {
                <W as Wrapper>::device(self)
            }
            fn describe(&self) -> String {
                <W as Wrapper>::describe(self)
            }
            fn supports(&self, op: Op) -> bool {
                <W as Wrapper>::supports(self, op)
            }
            fn stats(&self) -> DeviceStats {
                <W as Wrapper>::stats(self)
            }
            fn health(&self) -> Result<()> {
                <W as Wrapper>::health(self)
            }
            fn begin_step(&self, key: u64) -> Result<()> {
                <W as Wrapper>::begin_step(self, key)
            }
            fn end_step(&self) -> Result<()> {
                <W as Wrapper>::end_step(self)
            }
        }
    };
}
