//! The files a connection reads its credentials and certificates from (a password or token
//! file, a NATS credentials file, a CA, a client certificate and key), watched for change.
//! They are rotated in place on real fleets (Kubernetes secrets swap a symlink, cert-manager
//! and the Key Vault extension rewrite the file, certbot renews): a connection made with the
//! old ones is made again with the new ones before its next use, rather than used until it
//! fails, or kept failing with what was read at start.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The paths among a configuration's optional `*_file` keys that are set.
pub fn given<const N: usize>(files: [&Option<PathBuf>; N]) -> Vec<&Path> {
    files.into_iter().flatten().map(PathBuf::as_path).collect()
}

/// What a set of files looked like: device, inode, size, modification and change times of
/// each (following symlinks, so a swapped `..data` link shows), or that it could not be read.
/// Two stamps differ when any file was replaced, rewritten, appeared or went away.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stamp(Vec<Option<FileState>>);

/// Device, inode, size, then modification and change times (seconds, nanoseconds).
type FileState = (u64, u64, u64, i64, i64, i64, i64);

impl Stamp {
    /// The files' stamp now (a `stat` each).
    pub fn of<'a>(paths: impl IntoIterator<Item = &'a Path>) -> Stamp {
        Stamp(
            paths
                .into_iter()
                .map(|path| {
                    std::fs::metadata(path).ok().map(|m| {
                        (
                            m.dev(),
                            m.ino(),
                            m.size(),
                            m.mtime(),
                            m.mtime_nsec(),
                            m.ctime(),
                            m.ctime_nsec(),
                        )
                    })
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rewritten_replaced_or_removed_file_changes_the_stamp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "one").unwrap();
        let first = Stamp::of([path.as_path()]);
        assert_eq!(first, Stamp::of([path.as_path()]), "nothing changed");
        // Rewritten in place, same size.
        std::thread::sleep(std::time::Duration::from_millis(5));
        std::fs::write(&path, "two").unwrap();
        let second = Stamp::of([path.as_path()]);
        assert_ne!(first, second);
        // Replaced by a rename (a new inode), as most rotations do.
        let staged = dir.path().join("token.new");
        std::fs::write(&staged, "two").unwrap();
        std::fs::rename(&staged, &path).unwrap();
        let third = Stamp::of([path.as_path()]);
        assert_ne!(second, third);
        // Gone, then back.
        std::fs::remove_file(&path).unwrap();
        let gone = Stamp::of([path.as_path()]);
        assert_ne!(third, gone);
        std::fs::write(&path, "two").unwrap();
        assert_ne!(gone, Stamp::of([path.as_path()]));
    }

    #[test]
    fn a_swapped_symlink_changes_the_stamp() {
        // Kubernetes mounts a secret as token -> ..data/token, ..data -> ..2026_11_27_1
        // and swaps ..data on an update.
        let dir = tempfile::tempdir().unwrap();
        for (version, text) in [("v1", "one"), ("v2", "two")] {
            std::fs::create_dir(dir.path().join(version)).unwrap();
            std::fs::write(dir.path().join(version).join("token"), text).unwrap();
        }
        std::os::unix::fs::symlink("v1", dir.path().join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/token", dir.path().join("token")).unwrap();
        let path = dir.path().join("token");
        let before = Stamp::of([path.as_path()]);
        std::os::unix::fs::symlink("v2", dir.path().join("..data.new")).unwrap();
        std::fs::rename(dir.path().join("..data.new"), dir.path().join("..data")).unwrap();
        assert_ne!(before, Stamp::of([path.as_path()]));
    }
}
