//! The CNI plugin the container runtime execs; see [`ambit_cni::plugin`].

fn main() {
    std::process::exit(ambit_cni::plugin::main());
}
