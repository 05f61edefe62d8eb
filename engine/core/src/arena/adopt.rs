//! Adopting the arena memfd of a previous daemon (takeover): same bytes, new mapping.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use memmap2::{Advice, MmapOptions};

use super::{Arena, ArenaError, PinProgress};

impl Arena {
    /// Maps the arena memfd `fd` handed over by the previous daemon. It must be exactly
    /// `len` bytes and sealed against resizing (as [`Arena::create`] leaves it), so no client
    /// holding the descriptor can shrink it under this daemon's mapping.
    pub fn adopt(fd: File, len: u64) -> Result<Self, ArenaError> {
        let have = fd
            .metadata()
            .map_err(|e| ArenaError::Truncate(e, len))?
            .len();
        if have != len {
            return Err(ArenaError::Truncate(
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("the handed-over arena has {have} bytes, this daemon expects {len}"),
                ),
                len,
            ));
        }
        // SAFETY: fcntl on a valid descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals < 0 || seals & need != need {
            return Err(ArenaError::Seal(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the handed-over arena is not a memfd sealed against resizing",
            )));
        }
        let bytes = usize::try_from(len)
            .map_err(|_| ArenaError::Map(std::io::ErrorKind::InvalidInput.into(), len))?;
        let map = MmapOptions::new()
            .len(bytes)
            .map_raw(&fd)
            .map_err(|e| ArenaError::Map(e, len))?;
        let _ = map.advise(Advice::HugePage);
        Ok(Self {
            fd,
            map,
            len,
            progress: Arc::new(PinProgress::default()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    #[test]
    fn an_adopted_arena_sees_the_old_bytes_and_refuses_a_wrong_size() {
        let a = Arena::create(8 << 20, false).unwrap();
        // SAFETY: the test owns the whole arena.
        unsafe { a.slice_mut(4096, 4) }.copy_from_slice(b"kept");
        let fd = File::from(a.fd().try_clone_to_owned().unwrap());
        let again = File::from(a.fd().try_clone_to_owned().unwrap());
        drop(a);
        let b = Arena::adopt(fd, 8 << 20).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { b.slice(4096, 4) }, b"kept");
        assert!(Arena::adopt(again, 16 << 20).is_err());
    }

    #[test]
    fn an_unsealed_file_is_refused() {
        let f = File::from(
            // SAFETY: memfd_create with a valid name.
            unsafe {
                std::os::fd::OwnedFd::from_raw_fd(libc::memfd_create(
                    c"plain".as_ptr(),
                    libc::MFD_CLOEXEC,
                ))
            },
        );
        f.set_len(8 << 20).unwrap();
        assert!(matches!(Arena::adopt(f, 8 << 20), Err(ArenaError::Seal(_))));
    }
}
