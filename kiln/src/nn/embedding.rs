//! Lookup tables: [`Embedding`] (PyTorch's `nn.Embedding`) and the
//! functional [`embedding`] (`F.embedding`).

use super::module::{input_device_mismatch, Module, ParamVisitor};
use crate::{DType, Device, Error, Result, Tensor};

/// The rows of `weight` (num_embeddings, dim) at `ids` (i64, i32 or u8 of
/// any shape, on the weight's device): a tensor of shape `ids.shape + [dim]`
/// (PyTorch's `F.embedding(ids, weight)`). The gradient adds each output row
/// into the row of `weight` it came from (repeated ids accumulate).
///
/// An id below 0 or at least num_embeddings is an `InvalidArgument` error on
/// the CPU; on a GPU the ids are not read back: the kernel checks them and
/// the next synchronising call reports a bad one (as
/// [`Tensor::index_select`]; see the README's table of differences).
///
/// ```
/// use kiln::{Tensor, cpu};
/// let weight = Tensor::new(&[[0f32, 1.], [10., 11.], [20., 21.]], &cpu())?;
/// let ids = Tensor::new(&[[2i64, 0], [1, 1]], &cpu())?;
/// let out = kiln::nn::embedding(&ids, &weight)?;
/// assert_eq!(out.dims(), &[2, 2, 2]);
/// assert_eq!(out.to_vec::<f32>()?, vec![20., 21., 0., 1., 10., 11., 10., 11.]);
/// assert!(kiln::nn::embedding(&Tensor::new(&[3i64], &cpu())?, &weight).is_err());
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn embedding(ids: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if weight.rank() != 2 {
        return Err(Error::invalid("embedding", format!("the weight must be 2-D (num_embeddings, dim), got shape {}", weight.shape())));
    }
    if !matches!(ids.dtype(), DType::I64 | DType::I32 | DType::U8) {
        return Err(Error::invalid(
            "embedding",
            format!("ids must be integers (i64, i32 or u8), got {}; convert them with `.to_dtype(kiln::DType::I64)?`", ids.dtype()),
        ));
    }
    // index_select's errors, named after this function.
    let rows = weight.index_select(&ids.flatten_all()?, 0).map_err(|e| match e {
        Error::InvalidArgument { msg, .. } => Error::InvalidArgument { op: "embedding".into(), msg },
        Error::DeviceMismatch { lhs, rhs, .. } => Error::DeviceMismatch { op: "embedding".into(), lhs, rhs },
        other => other,
    })?;
    let mut dims = ids.dims().to_vec();
    dims.push(weight.dims()[1]);
    rows.reshape(dims)
}

/// A lookup table of `num_embeddings` vectors of size `embedding_dim`
/// (PyTorch's `nn.Embedding`): the forward maps ids (i64, i32 or u8, any
/// shape) to their rows, shape `ids.shape + [embedding_dim]` (see
/// [`embedding`]). The weight is initialized as PyTorch does, from N(0, 1),
/// from kiln's seeded generator. No `padding_idx`, `max_norm` or sparse
/// gradients.
///
/// ```
/// use kiln::nn::{Embedding, Module};
/// use kiln::{Tensor, cpu};
/// let emb = Embedding::new(10, 3, &cpu())?;
/// let ids = Tensor::new(&[[1i64, 2, 4], [4, 3, 9]], &cpu())?;
/// let out = emb.forward(&ids)?;
/// assert_eq!(out.dims(), &[2, 3, 3]);
/// out.sum_all()?.backward()?;
/// // Row 4 was used twice, row 0 never.
/// let g = emb.weight().grad().unwrap().to_vec2::<f32>()?;
/// assert_eq!((g[4][0], g[0][0]), (2., 0.));
/// assert_eq!(emb.parameter("weight")?.dims(), &[10, 3]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct Embedding {
    weight: Tensor,
}

impl std::fmt::Debug for Embedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Embedding {
    /// A table of `num_embeddings` f32 vectors of size `embedding_dim` on
    /// `device`.
    ///
    /// ```
    /// use kiln::nn::Embedding;
    /// let emb = Embedding::new(100, 8, &kiln::try_gpu(0))?;
    /// assert_eq!((emb.num_embeddings(), emb.embedding_dim()), (100, 8));
    /// assert_eq!(emb.weight().device(), kiln::try_gpu(0));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn new(num_embeddings: usize, embedding_dim: usize, device: &Device) -> Result<Embedding> {
        Embedding::with_dtype(num_embeddings, embedding_dim, DType::F32, device)
    }

    /// A table of a chosen float dtype.
    ///
    /// ```
    /// use kiln::nn::Embedding;
    /// let emb = Embedding::with_dtype(4, 2, kiln::DType::F64, &kiln::cpu())?;
    /// assert_eq!(emb.weight().dtype(), kiln::DType::F64);
    /// assert!(Embedding::with_dtype(0, 2, kiln::DType::F32, &kiln::cpu()).is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn with_dtype(num_embeddings: usize, embedding_dim: usize, dtype: DType, device: &Device) -> Result<Embedding> {
        if num_embeddings == 0 || embedding_dim == 0 {
            return Err(Error::invalid(
                "Embedding",
                format!("num_embeddings ({num_embeddings}) and embedding_dim ({embedding_dim}) must both be at least 1"),
            ));
        }
        let weight = Tensor::randn_with(0.0, 1.0, (num_embeddings, embedding_dim), dtype, device)?.requires_grad_();
        Ok(Embedding { weight })
    }

    /// A table with the given weight (num_embeddings, embedding_dim), marked
    /// as a parameter that shares storage with it (PyTorch's
    /// `Embedding.from_pretrained(w, freeze=False)`).
    ///
    /// ```
    /// use kiln::nn::{Embedding, Module};
    /// use kiln::{Tensor, cpu};
    /// let emb = Embedding::from_tensor(&Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?)?;
    /// assert_eq!(emb.forward(&Tensor::new(&[1i64], &cpu())?)?.to_vec2::<f32>()?, vec![vec![3., 4.]]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn from_tensor(weight: &Tensor) -> Result<Embedding> {
        if weight.rank() != 2 {
            return Err(Error::invalid("Embedding", format!("the weight must be 2-D (num_embeddings, dim), got shape {}", weight.shape())));
        }
        Ok(Embedding { weight: weight.detach().requires_grad_() })
    }

    /// The weight, (num_embeddings, embedding_dim). Shares storage with the
    /// layer's parameter.
    ///
    /// ```
    /// use kiln::nn::{Embedding, Module};
    /// let emb = Embedding::new(4, 2, &kiln::cpu())?;
    /// assert!(emb.weight().same_storage(&emb.parameter("weight")?));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn weight(&self) -> Tensor {
        self.weight.clone()
    }

    /// Number of vectors.
    ///
    /// ```
    /// assert_eq!(kiln::nn::Embedding::new(7, 3, &kiln::cpu())?.num_embeddings(), 7);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn num_embeddings(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Size of each vector.
    ///
    /// ```
    /// assert_eq!(kiln::nn::Embedding::new(7, 3, &kiln::cpu())?.embedding_dim(), 3);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn embedding_dim(&self) -> usize {
        self.weight.dims()[1]
    }
}

impl Module for Embedding {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(self.clone()))
    }
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if ids.device() != self.weight.device() {
            return Err(input_device_mismatch(ids.device(), "weight", self.weight.device()));
        }
        embedding(ids, &self.weight)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".to_string(), self.weight.clone())]
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("weight", &mut self.weight)
    }
    fn describe(&self) -> String {
        format!("Embedding(num={}, dim={}, {})", self.num_embeddings(), self.embedding_dim(), self.weight.device())
    }
}
