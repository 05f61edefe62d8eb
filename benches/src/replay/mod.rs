//! `kvnode bench replay`: production traces through real daemons (issue 40), with the offline
//! optimum beside every run.

pub mod offline;
pub mod trace;
