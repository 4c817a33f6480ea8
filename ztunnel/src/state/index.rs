//! Changes to a [`StateSnapshot`] that keep every index consistent.
//!
//! Only the writer calls these, on its private copy of the snapshot before
//! publishing it. `Arc::make_mut` copies an index the first time a change
//! touches it (the published snapshot still shares it) and never again
//! within the same batch.

use std::sync::Arc;

use super::{
    Address, Authorization, Endpoint, NetworkAddress, ResourceKey, ResourceType, Service,
    StateSnapshot, Workload, XdsEntry,
};

fn same_service(a: &Service, b: &Service) -> bool {
    a.namespace == b.namespace && a.hostname == b.hostname
}

impl StateSnapshot {
    /// Adds or replaces the workload with `w.uid`, updating the address and
    /// endpoint indexes (an address or service it no longer has is dropped).
    pub fn insert_workload(&mut self, w: Workload) -> Arc<Workload> {
        let w = Arc::new(w);
        let old = Arc::make_mut(&mut self.workloads).insert(w.uid.clone(), w.clone());
        let by_addr = Arc::make_mut(&mut self.workloads_by_addr);
        if let Some(old) = &old {
            for ip in &old.ips {
                let key = NetworkAddress::new(old.network.clone(), *ip);
                if by_addr.get(&key).is_some_and(|cur| cur.uid == old.uid) {
                    by_addr.remove(&key);
                }
            }
        }
        for ip in &w.ips {
            by_addr.insert(NetworkAddress::new(w.network.clone(), *ip), w.clone());
        }
        self.update_endpoints(&w.uid, old.as_deref(), Some(&w));
        w
    }

    /// Removes the workload `uid` from every index.
    pub fn remove_workload(&mut self, uid: &str) -> Option<Arc<Workload>> {
        if !self.workloads.contains_key(uid) {
            return None;
        }
        let old = Arc::make_mut(&mut self.workloads).remove(uid)?;
        let by_addr = Arc::make_mut(&mut self.workloads_by_addr);
        for ip in &old.ips {
            let key = NetworkAddress::new(old.network.clone(), *ip);
            if by_addr.get(&key).is_some_and(|cur| cur.uid == old.uid) {
                by_addr.remove(&key);
            }
        }
        self.update_endpoints(&old.uid, Some(&old), None);
        Some(old)
    }

    /// Moves workload `uid` between endpoint sets as its service list
    /// changes from `old` to `new`.
    fn update_endpoints(&mut self, uid: &Arc<str>, old: Option<&Workload>, new: Option<&Workload>) {
        if let (Some(o), Some(n)) = (old, new)
            && o.services == n.services
        {
            return;
        }
        let endpoints = Arc::make_mut(&mut self.endpoints);
        if let Some(old) = old {
            for key in old.services.keys() {
                if new.is_some_and(|n| n.services.contains_key(key)) {
                    continue;
                }
                if let Some(set) = endpoints.get_mut(key.as_str()) {
                    Arc::make_mut(set).remove(uid);
                    if set.is_empty() {
                        endpoints.remove(key.as_str());
                    }
                }
            }
        }
        if let Some(new) = new {
            for (key, ports) in &new.services {
                if old.is_some_and(|o| o.services.get(key) == Some(ports)) {
                    continue;
                }
                let service: Arc<str> = Arc::from(key.as_str());
                let set = endpoints.entry(service.clone()).or_default();
                Arc::make_mut(set).insert(
                    uid.clone(),
                    Endpoint {
                        workload_uid: uid.clone(),
                        service,
                        ports: ports.clone(),
                    },
                );
            }
        }
    }

    /// Adds or replaces the service `namespace/hostname`, updating the VIP
    /// index (a VIP it no longer has is dropped).
    pub fn insert_service(&mut self, s: Service) -> Arc<Service> {
        let key: Arc<str> = Arc::from(s.key());
        let s = Arc::new(s);
        let old = Arc::make_mut(&mut self.services).insert(key, s.clone());
        let by_vip = Arc::make_mut(&mut self.services_by_vip);
        if let Some(old) = &old {
            for vip in &old.vips {
                if by_vip.get(vip).is_some_and(|cur| same_service(cur, old)) {
                    by_vip.remove(vip);
                }
            }
        }
        for vip in &s.vips {
            by_vip.insert(vip.clone(), s.clone());
        }
        s
    }

    /// Removes the service `namespace/hostname` and its VIPs. Its endpoints
    /// are no longer visible through [`StateSnapshot::endpoints`].
    pub fn remove_service(&mut self, key: &str) -> Option<Arc<Service>> {
        if !self.services.contains_key(key) {
            return None;
        }
        let old = Arc::make_mut(&mut self.services).remove(key)?;
        let by_vip = Arc::make_mut(&mut self.services_by_vip);
        for vip in &old.vips {
            if by_vip.get(vip).is_some_and(|cur| same_service(cur, &old)) {
                by_vip.remove(vip);
            }
        }
        Some(old)
    }

    /// Adds or replaces the policy `namespace/name`.
    pub fn insert_authorization(&mut self, a: Authorization) -> Arc<Authorization> {
        let a = Arc::new(a);
        Arc::make_mut(&mut self.policies).insert(Arc::from(a.key()), a.clone());
        a
    }

    /// Removes the policy `namespace/name`.
    pub fn remove_authorization(&mut self, key: &str) -> Option<Arc<Authorization>> {
        if !self.policies.contains_key(key) {
            return None;
        }
        Arc::make_mut(&mut self.policies).remove(key)
    }

    fn remove_key(&mut self, key: &ResourceKey) {
        match key {
            ResourceKey::Workload(uid) => {
                self.remove_workload(uid);
            }
            ResourceKey::Service(k) => {
                self.remove_service(k);
            }
            ResourceKey::Authorization(k) => {
                self.remove_authorization(k);
            }
        }
    }

    fn resources_mut(
        &mut self,
        ty: ResourceType,
    ) -> &mut std::collections::HashMap<String, XdsEntry> {
        match ty {
            ResourceType::Address => Arc::make_mut(&mut self.address_resources),
            ResourceType::Authorization => Arc::make_mut(&mut self.authorization_resources),
        }
    }

    /// Applies the xDS resource `name` at `version`: if the name stood for
    /// something else before, that is removed first.
    pub fn apply_address(&mut self, name: &str, version: &str, address: Address) {
        let key = match &address {
            Address::Workload(w) => ResourceKey::Workload(w.uid.clone()),
            Address::Service(s) => ResourceKey::Service(Arc::from(s.key())),
        };
        self.replace_entry(ResourceType::Address, name, version, key);
        match address {
            Address::Workload(w) => {
                self.insert_workload(*w);
            }
            Address::Service(s) => {
                self.insert_service(*s);
            }
        }
    }

    /// Applies the xDS authorization resource `name` at `version`.
    pub fn apply_authorization(&mut self, name: &str, version: &str, auth: Authorization) {
        let key = ResourceKey::Authorization(Arc::from(auth.key()));
        self.replace_entry(ResourceType::Authorization, name, version, key);
        self.insert_authorization(auth);
    }

    fn replace_entry(&mut self, ty: ResourceType, name: &str, version: &str, key: ResourceKey) {
        let previous = self.resources_mut(ty).insert(
            name.to_string(),
            XdsEntry {
                version: version.to_string(),
                key: key.clone(),
            },
        );
        if let Some(previous) = previous
            && previous.key != key
        {
            self.remove_key(&previous.key);
        }
    }

    /// Removes the xDS resource `name` of type `ty` and what it stood for.
    /// Returns false if it was not held.
    pub fn remove_resource(&mut self, ty: ResourceType, name: &str) -> bool {
        if !self.xds_resources(ty).contains_key(name) {
            return false;
        }
        match self.resources_mut(ty).remove(name) {
            Some(entry) => {
                self.remove_key(&entry.key);
                true
            }
            None => false,
        }
    }
}
