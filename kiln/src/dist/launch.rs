//! Which launcher started this process, read from the variables each one
//! sets: MPI launchers (`mpirun`/`mpiexec` of Open MPI or MPICH, Slurm's
//! `srun`, any PMIx launcher), then torchrun-style variables, else a world
//! of one.

use std::fmt;

/// What started this process, and where it stands in the job
/// ([`crate::dist::launch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// The launcher.
    pub launcher: Launcher,
    /// This process's rank in the job (0 for a world of one).
    pub rank: usize,
    /// The number of processes in the job (1 for a world of one).
    pub size: usize,
    /// This process's rank among those on its machine: the GPU it takes.
    pub local_rank: usize,
}

/// A launcher kiln recognises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// Open MPI's `mpirun`/`mpiexec` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// MPICH's or Intel MPI's Hydra `mpiexec` (`PMI_RANK`, `PMI_SIZE`).
    Hydra,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS` in a job step).
    Slurm,
    /// Another PMIx launcher (`PMIX_RANK`).
    Pmix,
    /// torchrun-style variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `MASTER_ADDR`, `MASTER_PORT`.
    Torchrun,
    /// Started on its own: a world of one.
    Single,
}

impl Launcher {
    /// Whether processes of this launch talk through MPI.
    pub fn is_mpi(self) -> bool {
        match self {
            Launcher::OpenMpi | Launcher::Hydra | Launcher::Slurm | Launcher::Pmix => true,
            Launcher::Torchrun | Launcher::Single => false,
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::OpenMpi => "Open MPI's mpirun",
            Launcher::Hydra => "MPICH's mpiexec (Hydra)",
            Launcher::Slurm => "Slurm's srun",
            Launcher::Pmix => "a PMIx launcher",
            Launcher::Torchrun => "torchrun-style variables",
            Launcher::Single => "no launcher",
        })
    }
}

impl fmt::Display for Launch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.launcher {
            Launcher::Single => f.write_str("a world of one (no launcher)"),
            l => write!(f, "rank {} of {} (local rank {}) under {l}", self.rank, self.size, self.local_rank),
        }
    }
}

/// Reads the launch from `var` (the process environment in
/// [`crate::dist::launch`]): the first launcher whose rank and size are
/// both set and valid wins.
pub(crate) fn detect(var: &dyn Fn(&str) -> Option<String>) -> Result<Launch, String> {
    let num = |name: &str| -> Result<Option<usize>, String> {
        match var(name) {
            None => Ok(None),
            Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| format!("{name}={v:?} is not a non-negative whole number")),
        }
    };
    let candidates: [(Launcher, &str, &str, &[&str]); 5] = [
        (Launcher::OpenMpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", &["OMPI_COMM_WORLD_LOCAL_RANK"]),
        (Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", &["SLURM_LOCALID"]),
        (Launcher::Hydra, "PMI_RANK", "PMI_SIZE", &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"]),
        (Launcher::Pmix, "PMIX_RANK", "PMIX_SIZE", &["PMIX_LOCAL_RANK"]),
        (Launcher::Torchrun, "RANK", "WORLD_SIZE", &["LOCAL_RANK"]),
    ];
    for (launcher, rank_var, size_var, local_vars) in candidates {
        // `srun` sets SLURM_PROCID only inside a job step; an `sbatch`
        // script's own shell has SLURM_JOB_ID without a step.
        if launcher == Launcher::Slurm && var("SLURM_STEP_ID").is_none() {
            continue;
        }
        let (Some(rank), Some(size)) = (num(rank_var)?, num(size_var)?) else { continue };
        if size == 0 || rank >= size {
            return Err(format!("{rank_var}={rank} and {size_var}={size} do not make a rank of a job (0 ≤ rank < size)"));
        }
        let mut local_rank = None;
        for v in local_vars {
            if let Some(l) = num(v)? {
                local_rank = Some(l);
                break;
            }
        }
        return Ok(Launch { launcher, rank, size, local_rank: local_rank.unwrap_or(rank) });
    }
    Ok(Launch { launcher: Launcher::Single, rank: 0, size: 1, local_rank: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<Launch, String> {
        let map: std::collections::HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        detect(&|k| map.get(k).cloned())
    }

    #[test]
    fn each_launcher_is_read_from_its_own_variables() {
        let l = with(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "8"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1")]).unwrap();
        assert_eq!(l, Launch { launcher: Launcher::OpenMpi, rank: 3, size: 8, local_rank: 1 });
        let l = with(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "0"), ("SLURM_STEP_ID", "0")]).unwrap();
        assert_eq!(l, Launch { launcher: Launcher::Slurm, rank: 2, size: 4, local_rank: 0 });
        // An sbatch script's shell is not a rank.
        assert_eq!(with(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]).unwrap().launcher, Launcher::Single);
        let l = with(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]).unwrap();
        assert_eq!((l.launcher, l.local_rank), (Launcher::Hydra, 1));
        let l = with(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")]).unwrap();
        assert_eq!(l.launcher, Launcher::Torchrun);
        assert!(!l.launcher.is_mpi());
        assert_eq!(with(&[]).unwrap(), Launch { launcher: Launcher::Single, rank: 0, size: 1, local_rank: 0 });
    }

    #[test]
    fn a_rank_outside_its_world_or_a_word_is_an_error_naming_the_variable() {
        assert!(with(&[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "2")]).unwrap_err().contains("OMPI_COMM_WORLD_RANK=2"));
        assert!(with(&[("RANK", "one"), ("WORLD_SIZE", "2")]).unwrap_err().contains("RANK=\"one\""));
        assert!(with(&[("RANK", "0"), ("WORLD_SIZE", "0")]).is_err());
    }
}
