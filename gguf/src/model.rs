//! Opening GGUF files: one validated file over a memory map ([`GgufFile`]) and a whole model that
//! may be split over shards, opened from any of them ([`Model`]).

use crate::error::{Error, Result};
use crate::metadata::Metadata;
use crate::reader::{Header, TensorInfo};
use crate::split;
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

enum Bytes {
    Mapped(Mmap),
    Static(&'static [u8]),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Static(s) => s,
        }
    }
}

/// What a path is, in words ("a FIFO"), for messages refusing non-regular files.
pub fn file_kind(ft: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_file() {
        "a regular file"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// One GGUF file, parsed and validated (header and data extents), its bytes memory-mapped.
pub struct GgufFile {
    path: PathBuf,
    header: Header,
    bytes: Bytes,
    /// The open file, for streaming copies that should not go through the map.
    file: Option<File>,
}

impl GgufFile {
    /// Map and validate a file. Only the header pages are touched; tensor data is read lazily.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let io = |source| Error::Io {
            path: path.clone(),
            source,
        };
        // O_NONBLOCK: opening a FIFO for reading would otherwise block until a writer appears.
        // The type check on the opened file then refuses FIFOs, devices and directories before
        // anything is read (a read of /dev/zero never ends; a FIFO's bytes cannot be mapped).
        let f = {
            use std::os::unix::fs::OpenOptionsExt;
            File::options()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&path)
                .map_err(io)?
        };
        let meta = f.metadata().map_err(io)?;
        if !meta.file_type().is_file() {
            return Err(Error::NotRegularFile {
                path,
                kind: file_kind(&meta.file_type()),
            });
        }
        let len = meta.len();
        let bytes = if len == 0 {
            Bytes::Static(&[])
        } else {
            // SAFETY: the map is read-only; a concurrent writer truncating the file could fault
            // reads, the same contract every mmap-based model loader (llama.cpp, candle) has.
            Bytes::Mapped(unsafe { Mmap::map(&f) }.map_err(io)?)
        };
        let mut g = Self::from_bytes(bytes, path)?;
        g.file = Some(f);
        Ok(g)
    }

    /// A file held in static memory (the bundled demo model).
    pub fn from_static(bytes: &'static [u8], name: impl Into<PathBuf>) -> Result<GgufFile> {
        Self::from_bytes(Bytes::Static(bytes), name.into())
    }

    fn from_bytes(bytes: Bytes, path: PathBuf) -> Result<GgufFile> {
        let data = bytes.as_slice();
        let header = Header::parse_slice(data, path.clone())?;
        header.check_data_layout(data.len() as u64)?;
        Ok(GgufFile {
            path,
            header,
            bytes,
            file: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The open file (`None` for a model in static memory).
    pub fn file(&self) -> Option<&File> {
        self.file.as_ref()
    }
    pub fn header(&self) -> &Header {
        &self.header
    }
    pub fn version(&self) -> u32 {
        self.header.version
    }
    pub fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }
    pub fn file_size(&self) -> u64 {
        self.bytes.as_slice().len() as u64
    }
    /// All bytes of the file.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// A tensor's stored bytes (extents were validated at open).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.header.data_offset + t.offset) as usize;
        &self.bytes.as_slice()[start..start + t.n_bytes() as usize]
    }

    /// `split.*` keys of this file, when present and well-typed.
    pub fn split_info(&self) -> Result<Option<SplitInfo>> {
        let m = self.metadata();
        let no = m.get(split::KEY_NO);
        let count = m.get(split::KEY_COUNT);
        if no.is_none() && count.is_none() {
            return Ok(None);
        }
        let int = |key: &str| -> Result<u64> { m.get_u64(key) };
        Ok(Some(SplitInfo {
            no: int(split::KEY_NO)?,
            count: int(split::KEY_COUNT)?,
            tensors_count: match m.get(split::KEY_TENSORS_COUNT) {
                Some(v) => Some(v.as_u64().ok_or_else(|| Error::WrongType {
                    file: self.path.clone(),
                    key: split::KEY_TENSORS_COUNT.into(),
                    expected: "non-negative integer",
                    got: v.value_type().to_string(),
                })?),
                None => None,
            },
        }))
    }
}

/// The `split.*` keys of one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SplitInfo {
    pub no: u64,
    pub count: u64,
    pub tensors_count: Option<u64>,
}

/// A tensor of a model and the shard holding it.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub info: &'a TensorInfo,
    pub shard: usize,
}

/// A whole model: one file, or every shard of a split model, opened from any shard and checked
/// as a set (same count everywhere, each `split.no` once, total tensor count, no duplicates).
pub struct Model {
    shards: Vec<GgufFile>,
    index: HashMap<String, (usize, usize)>,
}

impl Model {
    /// Open a model from a file or any of its shards.
    pub fn open(path: impl AsRef<Path>) -> Result<Model> {
        let path = path.as_ref();
        let first = GgufFile::open(path)?;
        match first.split_info()? {
            Some(si) if si.count > 1 => {
                let paths = split::sibling_paths(path).ok_or_else(|| Error::Split {
                    file: path.to_path_buf(),
                    message: format!(
                        "split.count is {} but the name does not end in -NNNNN-of-{:05}.gguf, so the other shards cannot be found (pass them explicitly)",
                        si.count, si.count
                    ),
                })?;
                if paths.len() as u64 != si.count {
                    return Err(Error::Split {
                        file: path.to_path_buf(),
                        message: format!(
                            "file name says {} shards but split.count is {}",
                            paths.len(),
                            si.count
                        ),
                    });
                }
                let mut shards = Vec::with_capacity(paths.len());
                let mut first = Some(first);
                for p in &paths {
                    let same = p == path;
                    let f = match (same, first.take()) {
                        (true, Some(f)) => f,
                        (_, f0) => {
                            first = f0;
                            if !p.exists() {
                                return Err(Error::Split {
                                    file: path.to_path_buf(),
                                    message: format!("shard {} is missing", p.display()),
                                });
                            }
                            GgufFile::open(p)?
                        }
                    };
                    shards.push(f);
                }
                Self::from_shards(shards)
            }
            _ => Self::from_shards(vec![first]),
        }
    }

    /// The bundled demo model or any GGUF held in static memory.
    pub fn from_static(bytes: &'static [u8], name: impl Into<PathBuf>) -> Result<Model> {
        Self::from_shards(vec![GgufFile::from_static(bytes, name)?])
    }

    /// Check a list of shards (in any order) forms one model, and index its tensors.
    pub fn from_shards(shards: Vec<GgufFile>) -> Result<Model> {
        if shards.is_empty() {
            return Err(Error::Split {
                file: PathBuf::new(),
                message: "no files given".into(),
            });
        }
        let shards = if shards.len() > 1 || shards[0].split_info()?.is_some_and(|s| s.count > 1) {
            check_split_set(shards)?
        } else {
            shards
        };
        let mut index = HashMap::new();
        for (si, f) in shards.iter().enumerate() {
            for (ti, t) in f.tensors().iter().enumerate() {
                if let Some((prev, _)) = index.insert(t.name.clone(), (si, ti)) {
                    return Err(Error::Split {
                        file: f.path().to_path_buf(),
                        message: format!(
                            "tensor {:?} is also in {}",
                            t.name,
                            shards[prev].path().display()
                        ),
                    });
                }
            }
        }
        Ok(Model { shards, index })
    }

    /// Index files without checking they form a complete split set (describing one shard alone).
    /// Duplicate tensor names across the files keep the first.
    pub fn from_shards_unchecked(shards: Vec<GgufFile>) -> Model {
        let mut index = HashMap::new();
        for (si, f) in shards.iter().enumerate() {
            for (ti, t) in f.tensors().iter().enumerate() {
                index.entry(t.name.clone()).or_insert((si, ti));
            }
        }
        Model { shards, index }
    }

    pub fn shards(&self) -> &[GgufFile] {
        &self.shards
    }
    /// Shard 0's metadata (architecture, tokenizer and hyper-parameters live there).
    pub fn metadata(&self) -> &Metadata {
        self.shards[0].metadata()
    }
    pub fn architecture(&self) -> Option<&str> {
        self.metadata().architecture()
    }
    pub fn path(&self) -> &Path {
        self.shards[0].path()
    }
    pub fn n_tensors(&self) -> usize {
        self.index.len()
    }

    /// Every tensor, shard by shard in file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorRef<'_>> {
        self.shards.iter().enumerate().flat_map(|(shard, f)| {
            f.tensors()
                .iter()
                .map(move |info| TensorRef { info, shard })
        })
    }

    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let &(s, t) = self.index.get(name)?;
        Some(TensorRef {
            info: &self.shards[s].tensors()[t],
            shard: s,
        })
    }

    pub fn data(&self, t: &TensorRef<'_>) -> &[u8] {
        self.shards[t.shard].tensor_data(t.info)
    }

    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor(name).ok_or_else(|| Error::NoSuchTensor {
            file: self.path().to_path_buf(),
            tensor: name.to_string(),
        })?;
        Ok(self.data(&t))
    }

    /// Total bytes of all shard files.
    pub fn total_file_size(&self) -> u64 {
        self.shards.iter().map(GgufFile::file_size).sum()
    }
}

/// Validate a shard set (any order) and return it sorted by `split.no`.
fn check_split_set(shards: Vec<GgufFile>) -> Result<Vec<GgufFile>> {
    let mut infos = Vec::with_capacity(shards.len());
    for f in &shards {
        let si = f.split_info()?.ok_or_else(|| Error::Split {
            file: f.path().to_path_buf(),
            message: "not a shard: no split.no / split.count keys".into(),
        })?;
        infos.push(si);
    }
    let count = infos[0].count;
    let first = shards[0].path().to_path_buf();
    for (f, si) in shards.iter().zip(&infos) {
        if si.count != count {
            return Err(Error::Split {
                file: f.path().to_path_buf(),
                message: format!(
                    "split.count is {} but {} says {}: shards of different splits",
                    si.count,
                    first.display(),
                    count
                ),
            });
        }
    }
    if count as usize != shards.len() {
        return Err(Error::Split {
            file: first,
            message: format!(
                "split.count is {count} but {} shards were given",
                shards.len()
            ),
        });
    }
    let mut slots: Vec<Option<GgufFile>> = (0..shards.len()).map(|_| None).collect();
    for (f, si) in shards.into_iter().zip(&infos) {
        let Some(slot) = slots.get_mut(si.no as usize) else {
            return Err(Error::Split {
                file: f.path().to_path_buf(),
                message: format!("split.no {} is out of range for split.count {count}", si.no),
            });
        };
        if let Some(other) = slot {
            return Err(Error::Split {
                file: f.path().to_path_buf(),
                message: format!(
                    "split.no {} is also claimed by {}",
                    si.no,
                    other.path().display()
                ),
            });
        }
        *slot = Some(f);
    }
    // Every slot is filled: `count` shards with distinct in-range numbers.
    let sorted: Vec<GgufFile> = slots.into_iter().flatten().collect();
    let total: u64 = sorted.iter().map(|f| f.tensors().len() as u64).sum();
    match sorted[0].split_info()?.and_then(|s| s.tensors_count) {
        Some(n) if n == total => {}
        Some(n) => {
            return Err(Error::Split {
                file: sorted[0].path().to_path_buf(),
                message: format!("split.tensors.count is {n} but the shards hold {total} tensors"),
            })
        }
        None => {
            return Err(Error::Split {
                file: sorted[0].path().to_path_buf(),
                message: "split.tensors.count is missing".into(),
            })
        }
    }
    let ids: Vec<(&Path, Option<&str>)> = sorted
        .iter()
        .map(|f| {
            let id = f.metadata().get(split::KEY_SET_ID).and_then(|v| v.as_str());
            (f.path(), id)
        })
        .collect();
    split::check_set_ids(&ids).map_err(|(file, message)| Error::Split { file, message })?;
    for f in &sorted[1..] {
        if let Some(n) = f.split_info()?.and_then(|s| s.tensors_count) {
            if n != total {
                return Err(Error::Split {
                    file: f.path().to_path_buf(),
                    message: format!("split.tensors.count is {n} but the set holds {total} tensors: shard of another split"),
                });
            }
        }
    }
    Ok(sorted)
}
