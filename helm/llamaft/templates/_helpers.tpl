{{- define "llamaft.name" -}}llamaft-operator{{- end -}}

{{- define "llamaft.labels" -}}
app.kubernetes.io/name: llamaft
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "llamaft.selectorLabels" -}}
app.kubernetes.io/name: llamaft
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The rules the operator needs: exactly the calls in operator/llamaft/operator/kube.py and kopf's own (tests compare). */}}
{{- define "llamaft.rules" -}}
# kopf watches and patches the LlamaFineTunes (finalizer, bookkeeping annotations); the operator
# reads them and writes their status.
- apiGroups: ["llamaft.io"]
  resources: ["llamafinetunes"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["llamaft.io"]
  resources: ["llamafinetunes/status"]
  verbs: ["patch"]
# Children carry an ownerReference with blockOwnerDeletion: clusters that enforce owner-reference
# permissions (OwnerReferencesPermissionEnforcement) require update on the owner's finalizers.
- apiGroups: ["llamaft.io"]
  resources: ["llamafinetunes/finalizers"]
  verbs: ["update"]
- apiGroups: ["kubeflow.org"]
  resources: ["pytorchjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["trainer.kubeflow.org"]
  resources: ["trainjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Server-side applied children: patch, and create when the apply creates them; list and delete
# prune; kopf watches them to repair hand edits.
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors", "prometheusrules"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# An elastic run's job that Kueue holds: its Workload tells whether it waits for quota (a shrink).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list"]
{{- end -}}


{{/* Several replicas peer (kopf --peering) through this object; one replica runs standalone. */}}
{{- define "llamaft.peered" -}}{{ if gt (int .Values.replicas) 1 }}true{{ end }}{{- end -}}
{{- define "llamaft.peeringName" -}}{{ include "llamaft.name" . }}-{{ .Release.Namespace }}{{- end -}}

{{/* kopf's cluster-scoped calls: it watches CRDs to follow resources as they are installed, and
     namespaces only when it serves given namespaces (tests/operator/test_rbac.py records them). */}}
{{- define "llamaft.crdRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end -}}

{{/* kopf's own calls for its peering (operator/llamaft/operator/peering.py; tests compare). */}}
{{- define "llamaft.clusterPeeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end -}}
{{- define "llamaft.namespacedPeeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end -}}
