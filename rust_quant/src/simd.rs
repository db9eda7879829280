//! Hot loops compiled twice: once for the x86-64 baseline (SSE2, what the wheel targets) and once with AVX2,
//! picked at run time. The loops are plain Rust that LLVM vectorises; AVX2 only widens the vectors. Results are
//! identical either way: Rust never fuses a multiply and an add or reorders float operations.

/// Defines a function (generic parameters with one bound each) whose body runs as AVX2 code when the CPU has it.
macro_rules! multiversion {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident<$($g:ident: $bound:path),*>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$meta])*
        $vis fn $name<$($g: $bound),*>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic<$($g: $bound),*>($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            unsafe fn avx2<$($g: $bound),*>($($arg: $ty),*) $(-> $ret)? {
                generic::<$($g),*>($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2, the only thing `avx2` requires beyond `generic`.
                return unsafe { avx2::<$($g),*>($($arg),*) };
            }
            generic::<$($g),*>($($arg),*)
        }
    };
}

pub(crate) use multiversion;
