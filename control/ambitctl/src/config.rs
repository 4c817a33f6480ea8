//! The one place this crate reaches into mesh config: the typed objects,
//! the YAML parser the control plane serves with, and its enrollment rule,
//! so the CLI reads a config directory exactly as the control plane and the
//! node agent do (all from the shared `ambit-config` crate).

pub(crate) use ambit_config::dir::split_documents;
pub(crate) use ambit_config::is_enrolled;
pub(crate) use ambit_config::limits::MAX_FILE_BYTES;
pub(crate) use ambit_config::objects::{LABEL_DATAPLANE_MODE, Labels, Object, Pod};
pub(crate) use ambit_config::{
    ConfigDir, DecodeError, DecodeFailure, config_files, decode_json_value, decode_yaml_document,
    parse_documents,
};
