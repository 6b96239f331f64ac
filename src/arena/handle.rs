//! [`HostHandle`] and [`DeviceHandle`]: typed names of arena requests.

use std::marker::PhantomData;
use std::mem::size_of;

#[cfg(doc)]
use super::ArenaPlan;

/// What a handle names: a request of one plan, in one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Key {
    pub(super) plan: u64,
    pub(super) generation: u64,
    pub(super) index: usize,
    pub(super) len: usize,
}

macro_rules! handle {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        pub struct $name<T> {
            pub(super) key: Key,
            _type: PhantomData<fn() -> T>,
        }

        impl<T> $name<T> {
            pub(super) fn new(key: Key) -> Self {
                $name { key, _type: PhantomData }
            }

            /// The number of values of `T` requested.
            pub fn len(&self) -> usize {
                self.key.len
            }

            /// Whether no values were requested (never: those are refused).
            pub fn is_empty(&self) -> bool {
                self.key.len == 0
            }

            /// The size of the request in bytes.
            pub fn num_bytes(&self) -> usize {
                self.key.len * size_of::<T>()
            }
        }

        impl<T> Clone for $name<T> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<T> Copy for $name<T> {}

        impl<T> PartialEq for $name<T> {
            fn eq(&self, other: &Self) -> bool {
                self.key == other.key
            }
        }

        impl<T> Eq for $name<T> {}

        impl<T> std::fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("type", &std::any::type_name::<T>())
                    .field("len", &self.key.len)
                    .field("request", &self.key.index)
                    .field("generation", &self.key.generation)
                    .finish()
            }
        }
    };
}

handle! {
    /// A request for `len` values of `T` in an [`ArenaPlan`]'s pinned host
    /// block. Resolve it with [`ArenaPlan::host_slice`] and
    /// [`ArenaPlan::host_slice_mut`] once the plan is satisfied.
    ///
    /// A handle is a name, not a borrow: it is `Copy`, and the plan checks
    /// it on every use (it must be this plan's, from the current generation,
    /// and assigned).
    HostHandle
}

handle! {
    /// A request for `len` values of `T` in an [`ArenaPlan`]'s device block.
    /// Resolve it with [`ArenaPlan::device_ptr`] (for kernels) and move data
    /// with [`ArenaPlan::copy_to_device`] and
    /// [`ArenaPlan::copy_from_device`].
    DeviceHandle
}
